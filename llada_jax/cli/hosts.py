"""Evaluation over several hosts: `--hosts` joins this process to a `jax.distributed` run, which gives it its
host number and count, and so its share of the problems (`eval.hosts.HostShare`)."""

from __future__ import annotations

import argparse

import jax

from eval.hosts import HostShare
from llada_jax.system.errors import LladaError


def add_host_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", default=None, metavar="auto|N",
                        help="split the problems over hosts, each writing its share to OUT-hostI-of-N.jsonl (merge "
                             "with `llada eval merge OUT`), joined through jax.distributed: auto reads the cluster "
                             "(SLURM, Open MPI, Kubernetes, Cloud TPU); N needs --coordinator and --host-id")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="with --hosts N: the address of host 0, where jax.distributed's coordinator runs")
    parser.add_argument("--host-id", type=int, default=None, help="with --hosts N: this host's number, 0..N-1")


def host_share(args) -> HostShare:
    """This process's share of the problems; joins the `jax.distributed` run first where --hosts asks."""
    if args.hosts is None:
        if args.coordinator is not None or args.host_id is not None:
            raise LladaError("--coordinator and --host-id go with --hosts N")
        return HostShare()
    if args.out is None:
        raise LladaError("--hosts needs --out: each host writes its share to its own part of that file")
    # Each host computes on its own devices only (its share of the problems), so CPU hosts need no
    # cross-process collectives (JAX's default, Gloo, would also print its connections on stdout).
    jax.config.update("jax_cpu_collectives_implementation", None)
    try:
        jax.distributed.initialize(**_distributed_args(args))
    except (RuntimeError, ValueError) as err:
        raise LladaError(f"cannot join the jax.distributed run: {str(err).splitlines()[0]}") from None
    return HostShare(jax.process_index(), jax.process_count())


def _distributed_args(args) -> dict:
    if args.hosts == "auto":
        if args.coordinator is not None or args.host_id is not None:
            raise LladaError("--hosts auto reads the coordinator and host number from the cluster; drop "
                             "--coordinator and --host-id, or give --hosts N")
        return {}
    try:
        count = int(args.hosts)
    except ValueError:
        raise LladaError(f"--hosts takes auto or a number of hosts, got {args.hosts!r}") from None
    if count < 1 or args.coordinator is None or args.host_id is None:
        raise LladaError("--hosts N needs N >= 1, --coordinator HOST:PORT and --host-id I")
    HostShare(args.host_id, count)  # checks the host number
    check_address(args.coordinator)
    return {"coordinator_address": args.coordinator, "num_processes": count, "process_id": args.host_id}


def check_address(address: str) -> None:
    """HOST:PORT, checked here: jax.distributed takes a malformed one to a segfault or a wait without end."""
    host, _, port = address.rpartition(":")
    if not host or host.startswith(":") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LladaError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {address!r}")
