"""`llada train`: the embedded tiny model trained on the task suite (resumable), or its newest checkpoint
exported."""

from __future__ import annotations

from llada_jax.cli.flags import path_arg
from llada_jax.system.errors import LladaError
from llada_jax.training.train import (
    TrainSettings,
    embedded_model_config,
    export_latest,
    train,
)


def cmd_train(args) -> None:
    if args.force and args.export_to is None:
        raise LladaError("--force replaces an earlier export: it goes with --export-to")
    if args.export_to is not None:
        out_dir, step = export_latest(args.out, args.export_to, force=args.force)
        print(f"checkpoint of step {step} exported to {out_dir}")
        return
    settings = TrainSettings(steps=args.steps, batch=args.batch, learning_rate=args.lr, seed=args.seed,
                             block_aware=args.block_aware, checkpoint_every=args.checkpoint_every)
    config = embedded_model_config(d_model=args.d_model, n_layers=args.n_layers)
    model_dir = train(args.out, settings, config, progress=not args.quiet, stop_at=args.stop_at)
    print(f"trained model written to {model_dir}")


def add_train(commands) -> None:
    """`llada train`."""
    tr = commands.add_parser("train", help="train the embedded tiny model on the task suite (resumable)")
    tr.add_argument("--out", required=True, type=path_arg,
                    help="run directory (checkpoints; the model lands in OUT/model)")
    tr.add_argument("--steps", type=int, default=24_000, help="length of the LR schedule")
    tr.add_argument("--batch", type=int, default=64)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--d-model", type=int, default=128)
    tr.add_argument("--n-layers", type=int, default=4)
    tr.add_argument("--block-aware", type=float, default=0.5, help="fraction of block-aware masked examples")
    tr.add_argument("--checkpoint-every", type=int, default=1000)
    tr.add_argument("--stop-at", type=int, default=None, help="stop (and export) at this step of the schedule")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument("--export-to", default=None, type=path_arg,
                    help="only export the run's newest checkpoint to this HF dir")
    tr.add_argument("--force", action="store_true", help="with --export-to: replace an earlier export there")
    tr.set_defaults(run=cmd_train)
