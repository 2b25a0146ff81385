"""The signed RunSpec is the run's settings (RunSettings) plus what the trainer fills in at start, encoded in the
field order specs have always had: a spec re-encodes to the bytes its signature covers."""

from __future__ import annotations

import msgpack

from intellect_protocol.codec import pack
from intellect_protocol.envelope import open_signed, seal
from intellect_protocol.identity import Identity
from intellect_protocol.messages import AdmissionSpec, ModelSpec, RunSettings, RunSpec, TrainSpec

KEY = Identity.generate()
FILLED_AT_START = {"protocol", "run_id", "created", "epoch"}


def _spec() -> RunSpec:
    return RunSpec(
        run_id=KEY.node_id,
        name="golden",
        created=1700000000.5,
        epoch=3,
        seed=7,
        model=ModelSpec(vocab=["<pad>", "<bos>", "<eos>", "1", "+"], hidden_size=64),
        train=TrainSpec(lr=3e-4),
        admission=AdmissionSpec(policy="invite"),
    )


def test_a_spec_is_the_run_settings_and_what_the_trainer_fills_in() -> None:
    assert set(RunSpec.model_fields) == set(RunSettings.model_fields) | FILLED_AT_START
    assert not set(RunSettings.model_fields) & FILLED_AT_START


def test_fields_are_encoded_in_the_wire_order() -> None:
    assert sorted(RunSpec.WIRE_ORDER) == sorted(RunSpec.model_fields)
    encoded = msgpack.unpackb(pack(_spec().model_dump(mode="python")), raw=False)
    assert list(encoded) == [
        "protocol",
        "run_id",
        "name",
        "created",
        "epoch",
        "seed",
        "model",
        "task",
        "sampling",
        "train",
        "verify",
        "admission",
    ]


def test_a_received_spec_encodes_to_the_bytes_it_was_signed_as() -> None:
    sealed = seal(KEY, _spec())
    body = msgpack.unpackb(sealed, raw=False)["body"]
    received = open_signed(sealed, RunSpec).message
    assert received == _spec()
    assert pack(received.model_dump(mode="python")) == body
