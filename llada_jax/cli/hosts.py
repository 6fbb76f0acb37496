"""Evaluation over several hosts: `--hosts` joins this process to a `jax.distributed` run, which gives it its
host number and count, and so its share of the problems (`eval.hosts.HostShare`)."""

from __future__ import annotations

import argparse
import os
import sys
import threading

import jax

from eval.hosts import HostShare
from llada_jax.system.errors import LladaError
from llada_jax.system.interrupts import Terminated

HOST_TIMEOUT_S = 300.0
MAX_HOST_TIMEOUT_S = 7 * 24 * 3600
ABORT_MARGIN_S = 60  # jax.distributed's own timeout (an abort) comes this long after ours


def add_host_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", default=None, metavar="auto|N",
                        help="split the problems over hosts, each writing its share to OUT-hostI-of-N.jsonl (merge "
                             "with `llada eval merge OUT`), joined through jax.distributed: auto reads the cluster "
                             "(SLURM, Open MPI, Kubernetes, Cloud TPU); N needs --coordinator and --host-id")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="with --hosts N: the address of host 0, where jax.distributed's coordinator runs")
    parser.add_argument("--host-id", type=int, default=None, help="with --hosts N: this host's number, 0..N-1")
    parser.add_argument("--host-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"with --hosts: how long to wait for every host to join (default: {HOST_TIMEOUT_S:g})")


def host_share(args) -> HostShare:
    """This process's share of the problems; joins the `jax.distributed` run first where --hosts asks."""
    if args.hosts is None:
        if args.coordinator is not None or args.host_id is not None or args.host_timeout is not None:
            raise LladaError("--coordinator, --host-id and --host-timeout go with --hosts")
        return HostShare()
    if args.out is None:
        raise LladaError("--hosts needs --out: each host writes its share to its own part of that file")
    # Each host computes on its own devices only (its share of the problems), so CPU hosts need no
    # cross-process collectives (JAX's default, Gloo, would also print its connections on stdout).
    jax.config.update("jax_cpu_collectives_implementation", None)
    join(_distributed_args(args), HOST_TIMEOUT_S if args.host_timeout is None else args.host_timeout)
    return HostShare(jax.process_index(), jax.process_count())


def join(distributed_args: dict, timeout_s: float) -> None:
    """`jax.distributed.initialize`, waited on here for at most `timeout_s`. It blocks in C++, deaf to Ctrl-C,
    and at its own timeout aborts the process with a stack dump; so it runs in a thread with a longer timeout,
    and this one gives up first, or on Ctrl-C/SIGTERM, with a one-line error and an immediate exit (a call
    blocked in C++ cannot be unwound)."""
    if not 0 < timeout_s <= MAX_HOST_TIMEOUT_S:
        raise LladaError(f"--host-timeout must be in (0, {MAX_HOST_TIMEOUT_S}] seconds, got {timeout_s}")
    failure: list[Exception] = []

    def connect() -> None:
        try:
            jax.distributed.initialize(**distributed_args, initialization_timeout=int(timeout_s) + ABORT_MARGIN_S)
        except (RuntimeError, ValueError) as err:
            failure.append(err)

    where = f" through {distributed_args['coordinator_address']}" if distributed_args else ""
    thread = threading.Thread(target=connect, name="jax.distributed join", daemon=True)
    try:
        thread.start()
        print(f"waiting up to {timeout_s:g} s for every host to join{where}", file=sys.stderr, flush=True)
        thread.join(timeout_s)
    except KeyboardInterrupt:
        _leave("llada: interrupted while waiting for the other hosts", 130)
    except Terminated as stop:
        _leave("llada: interrupted (SIGTERM) while waiting for the other hosts", stop.exit_status)
    if thread.is_alive():
        _leave(f"llada: error: not every host joined within {timeout_s:g} s (--host-timeout): start each host with "
               "the same --hosts and --coordinator, and a --host-id of its own", 1)
    if failure:
        raise LladaError(f"cannot join the jax.distributed run: {str(failure[0]).splitlines()[0]}")


def _leave(message: str, status: int) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(status)  # no interpreter shutdown: it would wait on the blocked join


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
    if not host or host.startswith(":") or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise LladaError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {address!r}")
