"""The ``intellect-node`` command: ``bootstrap`` a run, ``join`` one, run the local ``demo``; ``status``,
``doctor``, ``id`` and ``invite``.

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

ROLES_AVAILABLE = ("inference", "relay", "validator")


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir", type=Path, help="key and checkpoints (default: $INTELLECT_NODE_HOME or ~/.intellect-node)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and announce (default 127.0.0.1)")
    p.add_argument(
        "--announce",
        metavar="ADDRESS",
        help="address peers should dial, when not --host (a router forwarding the ports, or 0.0.0.0)",
    )
    p.add_argument("--p2p-port", type=int, default=0, help="libp2p TCP port (default: any free port)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port for weights and status (default: any free port)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--backend",
        choices=("transformers", "vllm", "auto"),
        help="inference: generation engine, the same as --set inference.backend=... (default "
        "transformers; vllm: see docs/inference.md; auto: vLLM where it is installed "
        "and a GPU is present)",
    )
    p.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda[:N]",
        help="where the transformers backend, the trainer and the validator compute (default auto: the "
        "first GPU where one is present, else the CPU)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    p.add_argument(
        "--relay-slots",
        type=int,
        help="nodes that may fetch weights from this one at once (default: from the measured upload)",
    )
    p.add_argument("--upload-limit-mbps", type=float, help="cap on weight upload, Mbit/s (default: none)")
    p.add_argument("--keep-versions", type=int, help="weight versions kept on disk (default: async_level + 1)")
    p.add_argument("--max-disk-gb", type=float, help="disk budget for weights (the newest version is always kept)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="run config TOML (see node/configs/tiny.toml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run setting, e.g. --set train.lr=1e-3 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="intellect-node",
        description="Peer-to-peer daemon for decentralized asynchronous RL training of language models.",
    )
    parser.add_argument("--version", action="version", version=f"intellect-node {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    boot = sub.add_parser("bootstrap", help="start a run: trainer role, first DHT peer, weight origin")
    _node_args(boot)
    _run_args(boot)
    boot.add_argument("--max-steps", type=int, help="stop training after this many steps (keeps serving)")
    boot.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="checkpoint every N steps (default 1; 0: never). Rerunning bootstrap with the same "
        "--data-dir resumes from the newest checkpoint",
    )
    boot.add_argument(
        "--track",
        choices=("none", "tensorboard", "wandb"),
        default="none",
        help="log each step's metrics to TensorBoard event files or W&B (offline mode)",
    )
    boot.add_argument("--track-dir", type=Path, help="where --track writes (default: <data dir>/tracking)")
    boot.add_argument("--fresh", action="store_true", help="discard this key's checkpoints and start the run over")
    boot.add_argument(
        "--peers",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="rejoin a running swarm's DHT through this peer (a restarted trainer otherwise uses the "
        "peers it saved in its checkpoint)",
    )
    boot.add_argument("--shard-mb", type=float, default=64.0, help="largest weight shard in MB (default 64)")
    boot.add_argument(
        "--stripes",
        type=int,
        default=4,
        help="stripes per version, each spread by its own relay tree (default 4; 1: a single tree)",
    )
    boot.add_argument(
        "--validator",
        action="append",
        default=[],
        metavar="NODE_ID",
        help="take verdicts from this validator (repeatable); else the trainer validates",
    )
    boot.add_argument(
        "--invite-uses",
        type=int,
        default=100,
        help='invite-only runs (admission.policy = "invite"): nodes the printed invite admits',
    )
    boot.add_argument("--invite-days", type=float, default=7.0, help="invite-only runs: days the printed invite lasts")

    join = sub.add_parser("join", help="join a run as a volunteer")
    _node_args(join)
    join.add_argument("--role", required=True, choices=ROLES_AVAILABLE, help="what this node does")
    join.add_argument(
        "--peers",
        action="append",
        default=[],
        required=True,
        metavar="MULTIADDR",
        help="a DHT peer to join through, as printed by `bootstrap` (repeatable)",
    )
    join.add_argument("--run-id", required=True, help="the run to join, as printed by `bootstrap`")
    join.add_argument("--join-timeout", type=float, default=60.0, help="seconds to look for the run (default 60)")
    join.add_argument("--no-relay", action="store_true", help="inference: do not serve weights to other nodes")
    join.add_argument("--invite", help="the invite an invite-only run asks for (from its operator)")
    join.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a node setting, e.g. --set inference.backend=vllm (repeatable)",
    )

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
        node_settings(split_overrides(args.overrides)[1])
        sys.exit(run_demo(args, run_config))

    if args.command == "invite":
        _invite(args)
        return
    if args.command == "status":
        from intellect_node.config import default_data_dir
        from intellect_node.doctor import show_status, status_url

        show_status(args.url or status_url(args.data_dir or default_data_dir()))
        return
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
    fields: dict[str, Any] = dict(
        host=args.host,
        announce=args.announce,
        p2p_port=args.p2p_port,
        http_port=args.http_port,
        threads=args.threads,
        device=args.device,
        relay_slots=args.relay_slots,
        upload_limit_mbps=args.upload_limit_mbps,
        keep_versions=args.keep_versions,
        max_disk_gb=args.max_disk_gb,
    )
    if args.data_dir is not None:
        fields["data_dir"] = args.data_dir
    _writable(fields.get("data_dir"))
    if args.backend is not None:
        fields["inference"] = {"backend": args.backend}
    run_overrides, node_overrides = split_overrides(args.overrides)
    if args.command == "join" and run_overrides:
        sys.exit(
            f"intellect-node: join --set {run_overrides[0]}: that is a run setting, which the run's trainer "
            "fixes (bootstrap --set); a volunteer sets only its own node's, e.g. inference.backend"
        )
    fields = node_settings(node_overrides, fields)  # --set inference.*: this node's
    from intellect_node.policy.model import resolve_device

    resolve_device(args.device)  # no GPU where one was asked for: say so now, not once the node has joined
    from intellect_node.runtime import run_until_signalled

    if args.command == "bootstrap":
        run = load_run_config(args.config, args.overrides)
        node = NodeConfig(
            **fields,
            max_steps=args.max_steps,
            shard_bytes=int(args.shard_mb * 2**20),
            stripes=args.stripes,
            validators=args.validator,
            checkpoint_every=args.checkpoint_every,
            fresh=args.fresh,
            track=args.track,
            track_dir=args.track_dir,
            peers=args.peers,
            invite_uses=args.invite_uses,
            invite_days=args.invite_days,
        )
        _bootstrap(node, run)
    elif args.command == "join":
        node = NodeConfig(
            **fields,
            peers=args.peers,
            run_id=args.run_id,
            join_timeout_s=args.join_timeout,
            relay=not args.no_relay,
            invite=args.invite,
        )
        if args.role == "relay":
            from intellect_node.roles.relay_node import RelayNode

            run_until_signalled(RelayNode(node).run())
        elif args.role == "validator":
            from intellect_node.roles.validator_node import ValidatorNode

            run_until_signalled(ValidatorNode(node).run())
        else:
            from intellect_node.roles.inference import InferenceNode

            run_until_signalled(InferenceNode(node).run())


def _writable(data_dir: Path | None) -> None:
    """The data dir exists (made if need be) and takes files: said now, with the flag to change, not as an errno
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
