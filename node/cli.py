"""The ``intellect-node`` command: ``bootstrap`` a run, ``join`` one, run the local ``demo``; ``status``,
``doctor``, ``id`` and ``invite``.

The node flags of ``bootstrap`` and ``join`` are made from NodeConfig's fields (node/config.py): name, type,
choices, default, bounds and help come from the field, so a node setting is declared once; a few flags keep an older
spelling (``FLAG_NAMES``). Given nowhere, a setting takes the field's default; ``--set key=value`` reaches the same
settings and wins over a flag.

Arguments are parsed before torch or hivemind is imported, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from intellect_node import __version__

if TYPE_CHECKING:
    from intellect_node.config import NodeConfig, RunConfig

ROLES_AVAILABLE = ("inference", "relay", "validator", "auditor")

FLAG_NAMES = {
    "inference.backend": "--backend",
    "join_timeout_s": "--join-timeout",
    "relay": "--no-relay",
    "shard_bytes": "--shard-mb",
    "validators": "--validator",
}
"""Node settings whose flag is not ``--`` and the field's name with dashes: names scripts and docs use, each
meaning exactly its field."""
METAVARS = {"announce": "ADDRESS", "device": "auto|cpu|cuda[:N]", "peers": "MULTIADDR", "validators": "NODE_ID"}
UNITS = {"shard_bytes": (2**20, "MB")}
"""Settings whose flag counts in a larger unit than the field: ``--shard-mb`` is MB, ``shard_bytes`` bytes."""
NODE = "node."
"""Prefix of the parsed arguments that are NodeConfig fields (``node.threads``, ``node.inference.backend``)."""


def _plain(text: str) -> str:
    """A field's docstring as flag help: no reST markup, one paragraph, ``%`` escaped for argparse."""
    return " ".join(text.replace("``", "").split()).replace("%", "%%")


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """(type, constraints) of an annotation such as ``Annotated[int, Field(ge=1)] | None``."""
    import types
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [c for e in extra for c in getattr(e, "metadata", [e])]
    return annotation, []


def _bounds(constraints: list[Any]) -> str:
    """What pydantic accepts, for the help: ``1 to 1024``, ``> 0``."""
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    limits = {a: getattr(c, a) for c in constraints for a in signs if hasattr(c, a)}
    if "ge" in limits and "le" in limits:
        return f"{limits['ge']} to {limits['le']}"
    return ", ".join(f"{signs[a]} {value}" for a, value in limits.items())


def _add_field_flag(p: Any, path: str, field: Any, required: bool = False) -> None:
    """One flag for the NodeConfig field at ``path``: its type, choices, default and bounds (for the help; pydantic
    enforces them) and its docstring as help. Given nowhere, a setting takes the field's default."""
    import typing

    kind, inner = _unwrap(field.annotation)
    constraints = [*inner, *field.metadata]
    factor, unit = UNITS.get(path, (1, ""))
    flag = FLAG_NAMES.get(path, "--" + path.rsplit(".", 1)[-1].replace("_", "-"))
    default = field.get_default(call_default_factory=False)
    notes = [f"in {unit}"] if unit else []
    if not (default is None or isinstance(default, bool) or default == [] or field.default_factory):
        notes.append(f"default {default / factor:g}" if isinstance(default, int | float) else f"default {default}")
    if constraints and not unit:
        notes.append(_bounds(constraints))
    notes = [n for n in notes if n]
    kwargs: dict[str, Any] = dict(
        dest=NODE + path,
        default=argparse.SUPPRESS,
        help=_plain(field.description or "") + (f" ({'; '.join(notes)})" if notes else ""),
    )
    if required:
        kwargs["required"] = True
    if kind is bool:
        kwargs["action"] = "store_false" if default else "store_true"
    elif typing.get_origin(kind) is list:
        kwargs.update(action="append", metavar=METAVARS.get(path, "VALUE"))
    elif typing.get_origin(kind) is typing.Literal:
        kwargs["choices"] = typing.get_args(kind)
    else:
        metavar = METAVARS.get(path, flag.removeprefix("--").replace("-", "_").upper())
        kwargs.update(type=float if unit else kind, metavar=metavar)
    p.add_argument(flag, **kwargs)


def _node_flags(p: argparse.ArgumentParser, role: str, required: tuple[str, ...] = ()) -> None:
    """A flag for every node setting the role takes (ROLE_SETTINGS in node/config.py), grouped as there."""
    from pydantic import BaseModel

    from intellect_node.config import ROLE_SETTINGS

    p.set_defaults(node_role=role)
    for model in ROLE_SETTINGS[role]:
        title = model.__name__.removesuffix("Settings").lower() + " settings"
        group = p.add_argument_group(title, _plain(model.__doc__ or ""))
        for name, field in model.model_fields.items():
            section = field.annotation
            if isinstance(section, type) and issubclass(section, BaseModel):
                for key, sub in section.model_fields.items():
                    _add_field_flag(group, f"{name}.{key}", sub, f"{name}.{key}" in required)
            else:
                _add_field_flag(group, name, field, name in required)


def node_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The NodeConfig fields given as flags, nested (``{"inference": {"backend": "vllm"}}``), in the fields' units."""
    fields: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(NODE):
            path = dest.removeprefix(NODE)
            *sections, name = path.split(".")
            at = fields
            for section in sections:
                at = at.setdefault(section, {})
            at[name] = int(value * UNITS[path][0]) if path in UNITS else value
    return fields


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="run config TOML (see node/configs/tiny.toml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run setting, e.g. --set train.lr=1e-3, or a node setting, e.g. --set threads=2 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="intellect-node",
        description="Peer-to-peer daemon for decentralized asynchronous RL training of language models.",
    )
    parser.add_argument("--version", action="version", version=f"intellect-node {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    boot = sub.add_parser("bootstrap", help="start a run: trainer role, first DHT peer, weight origin")
    _log_args(boot)
    _run_args(boot)
    _node_flags(boot, "trainer")

    join = sub.add_parser("join", help="join a run as a volunteer")
    _log_args(join)
    join.add_argument("--role", required=True, choices=ROLES_AVAILABLE, help="what this node does")
    join.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a node setting, e.g. --set inference.backend=vllm or --set threads=2 (repeatable)",
    )
    _node_flags(join, "volunteer", required=("peers", "run_id"))

    ident = sub.add_parser(
        "id",
        help="print this node's id (creating its key if there is none): give a validator's "
        "to the trainer's --validator before either starts",
    )
    ident.add_argument(
        "--data-dir", type=Path, help="the node's data dir (default: $INTELLECT_NODE_HOME or ~/.intellect-node)"
    )

    status = sub.add_parser("status", help="a running node's state in the terminal")
    status.add_argument("url", nargs="?", help="the node's HTTP URL (default: the node started with --data-dir)")
    status.add_argument(
        "--data-dir", type=Path, help="the node's data dir (default: $INTELLECT_NODE_HOME or ~/.intellect-node)"
    )

    doctor = sub.add_parser(
        "doctor",
        help="check this machine before joining: memory, disk, GPU, backend, clock, ports reachable from outside",
    )
    doctor.add_argument("--data-dir", type=Path, help="where the node would keep its files")
    doctor.add_argument("--config", type=Path, help="the run's config, for its model's size (default: the tiny run)")
    doctor.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    doctor.add_argument(
        "--peers",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="the run's join line: with --run-id, the trainer checks the ports from outside",
    )
    doctor.add_argument("--run-id")
    doctor.add_argument("--host", default="0.0.0.0", help="address the node would listen on (default 0.0.0.0)")
    doctor.add_argument("--p2p-port", type=int, default=0)
    doctor.add_argument("--http-port", type=int, default=0)

    invite = sub.add_parser("invite", help="mint an invite to the run whose key is in --data-dir (invite-only runs)")
    invite.add_argument("--data-dir", type=Path, help="the trainer's data dir (its node.key is the run key)")
    invite.add_argument("--uses", type=int, default=1, help="how many distinct nodes may join with it (default 1)")
    invite.add_argument("--days", type=float, default=7.0, help="how long it is valid (default 7 days)")

    credit = sub.add_parser(
        "credit",
        help="an inference node's batches against the trainer's contribution ledger: trained (proof checked), "
        "refused, acknowledged, lost",
    )
    credit.add_argument(
        "--data-dir",
        type=Path,
        help="the inference node's data dir (default: $INTELLECT_NODE_HOME or ~/.intellect-node)",
    )
    credit.add_argument("--run-id", help="the run (default: the one this node worked for last)")
    credit.add_argument("--trainer-url", help="the trainer's HTTP URL (default: the one its signed DHT record named)")

    audit = sub.add_parser(
        "audit",
        help="replay a training step from the trainer's checkpoint and ledger entry, and compare with the weights "
        "it published",
    )
    audit.add_argument("--data-dir", type=Path, help="the trainer's data dir (or a copy of it)")
    audit.add_argument("--version", type=int, help="the version whose step to replay (default: the newest)")
    audit.add_argument("--threads", type=int, default=1, help="CPU threads for the replay (default 1)")

    demo = sub.add_parser("demo", help="a whole swarm on this machine: one trainer, inference nodes, a summary")
    _run_args(demo)
    demo.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny model learning one-digit addition from scratch (half a minute) instead of "
        "SmolLM2-135M-Instruct learning two-digit addition (about 10 minutes)",
    )
    demo.add_argument("--minutes", type=float, default=7.0, help="training time of a pretrained model (default 7)")
    demo.add_argument(
        "--eval-problems", type=int, default=100, help="held-out problems scored before and after (default 100)"
    )
    demo.add_argument("--steps", type=int, help="training steps to run (default: 100 for --tiny, else no limit)")
    demo.add_argument(
        "--inference-nodes",
        type=int,
        help="inference processes (default: 2 for --tiny, else 1: a 2-core machine is full)",
    )
    demo.add_argument("--workdir", type=Path, help="where nodes keep keys, weights and logs (default: a temp dir)")
    demo.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from intellect_node.config import ledger_log_enabled

    if not ledger_log_enabled():  # (config.LEDGER_LOG_ENV)
        logging.getLogger("intellect_node.ledger").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    from intellect_node.runtime import return_freed_memory

    return_freed_memory()
    args = build_parser().parse_args(argv)
    import pydantic

    try:
        _main(args)
    except pydantic.ValidationError as e:
        problems = "; ".join(
            (".".join(map(str, err["loc"])) + ": " if err["loc"] else "") + err["msg"] for err in e.errors()
        )
        sys.exit(f"intellect-node: invalid setting: {problems}")
    except (ValueError, OSError) as e:
        sys.exit(f"intellect-node: {e}")


def _main(args: argparse.Namespace) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

    from intellect_node.config import NodeConfig, load_run_config, node_settings, split_overrides

    if args.command == "demo":
        from intellect_node.demo import run_demo

        if args.config is None and not args.tiny:
            from intellect_node.demo import SMOLLM2_CONFIG

            args.config = SMOLLM2_CONFIG
        run_config = load_run_config(args.config, args.overrides)  # validate before starting anything
        node_settings(split_overrides(args.overrides)[1], role="volunteer")  # the inference nodes'
        sys.exit(run_demo(args, run_config))

    if args.command == "invite":
        _invite(args)
        return
    if args.command == "status":
        from intellect_node.config import default_data_dir
        from intellect_node.doctor import show_status, status_url

        show_status(args.url or status_url(args.data_dir or default_data_dir()))
        return
    if args.command == "credit":
        from intellect_node.config import default_data_dir
        from intellect_node.roles.credit import report

        sys.exit(report(args.data_dir or default_data_dir(), args.run_id, args.trainer_url))
    if args.command == "audit":
        from intellect_node.config import default_data_dir
        from intellect_node.roles.audit import run_audit

        sys.exit(run_audit(args.data_dir or default_data_dir(), args.version, args.threads))
    if args.command == "doctor":
        from intellect_node.config import default_data_dir
        from intellect_node.doctor import run_doctor

        sys.exit(
            run_doctor(
                args.data_dir or default_data_dir(),
                args.config,
                args.backend,
                args.peers,
                args.run_id,
                args.host,
                args.p2p_port,
                args.http_port,
            )
        )
    if args.command == "id":
        from intellect_node.config import default_data_dir
        from intellect_node.p2p.keys import load_or_create

        print(load_or_create((args.data_dir or default_data_dir()) / "node.key").node_id)
        return
    _setup_logging(args.log_level)
    run_overrides, node_overrides = split_overrides(args.overrides)
    if args.command == "join" and run_overrides:
        sys.exit(
            f"intellect-node: join --set {run_overrides[0]}: that is a run setting, which the run's trainer "
            "fixes (bootstrap --set); a volunteer sets only its own node's, e.g. inference.backend or threads"
        )
    fields = node_settings(node_overrides, node_fields(args), role=args.node_role)  # --set wins over a flag
    from intellect_node.config import distributed_rank
    from intellect_node.runtime import lock_data_dir, run_until_signalled

    data_dir = _writable(Path(fields["data_dir"]) if "data_dir" in fields else None)
    if distributed_rank() == 0:  # under torchrun only rank 0 uses the data dir (_bootstrap)
        lock_data_dir(data_dir)
    from intellect_node.policy.model import resolve_device

    # no GPU where one was asked for: say so now, not once the node has joined
    resolve_device(str(fields.get("device", NodeConfig.model_fields["device"].default)))
    if args.command == "bootstrap":
        run = load_run_config(args.config, args.overrides)
        _bootstrap(NodeConfig(**fields), run)
        return
    node = NodeConfig(**fields)
    if args.role == "relay":
        from intellect_node.roles.relay_node import RelayNode

        run_until_signalled(RelayNode(node).run())
    elif args.role == "validator":
        from intellect_node.roles.validator_node import ValidatorNode

        run_until_signalled(ValidatorNode(node).run())
    elif args.role == "auditor":
        from intellect_node.roles.auditor_node import AuditorNode

        run_until_signalled(AuditorNode(node).run())
    else:
        from intellect_node.roles.inference import InferenceNode

        run_until_signalled(InferenceNode(node).run())


def _writable(data_dir: Path | None) -> Path:
    """The data dir (made if need be), once it takes files: said now, with the flag to change, not as an errno
    from deep inside a node."""
    import tempfile

    from intellect_node.config import default_data_dir

    path = data_dir or default_data_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        sys.exit(
            f"intellect-node: --data-dir {path}: cannot create or write files there ({e.strerror}); give a "
            "directory you can write to (or set INTELLECT_NODE_HOME)"
        )
    return path


def _invite(args: argparse.Namespace) -> None:
    from intellect_node.config import default_data_dir
    from intellect_node.roles.admission import mint_invite
    from intellect_protocol.identity import Identity

    key = (args.data_dir or default_data_dir()) / "node.key"
    if not key.exists():
        sys.exit(f"intellect-node: no run key at {key}; give the trainer's --data-dir")
    run_key = Identity.from_private_bytes(key.read_bytes())
    if args.days <= 0 or args.uses < 1:
        sys.exit(f"intellect-node invite: --days must be > 0 (not {args.days}) and --uses at least 1 (not {args.uses})")
    token = mint_invite(run_key, args.uses, args.days)
    print(f"--run-id {run_key.node_id} --invite {token}")


def _bootstrap(node: NodeConfig, run: RunConfig) -> None:
    """One process, or under torchrun (WORLD_SIZE > 1) the policy sharded over every rank with FSDP2: rank 0 runs
    the trainer (the only rank with ports and a DHT peer), the others follow it (node/policy/fsdp.py)."""
    from intellect_node.policy.fsdp import distributed_env
    from intellect_node.roles.trainer import Trainer
    from intellect_node.runtime import run_until_signalled

    placement = distributed_env()
    if placement is None:
        run_until_signalled(Trainer(node, run).run())
        return
    from intellect_node.policy import fsdp

    fsdp.init()
    try:
        if placement.rank == 0:
            trainer = Trainer(node, run, fsdp.sharded_engine)
            try:
                run_until_signalled(trainer.run(), hard_exit=False)  # the ranks are shut down below
            finally:
                trainer.engine.close()
        else:
            import torch

            torch.set_num_threads(node.threads)
            try:
                fsdp.follow_rank0()
            except fsdp.RankLost as e:
                sys.exit(f"intellect-node (rank {placement.rank}): {e}")
    finally:
        fsdp.shutdown()


if __name__ == "__main__":
    main()
