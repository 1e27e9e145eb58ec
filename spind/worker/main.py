"""A worker process: `python -m spind.worker.main --name NAME --config RUN_DIR/config-PID.json --endpoint ipc://...`.

Socket: one DEALER, connected to a DEALER the coordinator binds for this worker incarnation. DEALER and
not REQ (lockstep) so the coordinator can queue several ops (add + propose, or a low-priority precompute)
and the worker can see whether anything else is waiting; not one shared ROUTER because a restarted worker
gets a fresh endpoint and thus never receives replies-in-flight meant for the incarnation that died.
Draft probabilities travel worker to worker (`spind.worker.probs`): the target binds `--probs-endpoint`,
drafter workers connect to it.

Device: the launcher shows a GPU worker its one GPU (CUDA_VISIBLE_DEVICES) and names it here (`--device cuda:0`);
the worker pins it before any CUDA work. A lost device (a sticky CUDA error) ends the process with
EXIT_DEVICE_ERROR instead of a reply: the coordinator restarts it, with a fresh CUDA context, and replays its
requests, as after a crash.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import zmq

from spind import protocol as P
from spind.config import from_dict
from spind.worker.device import EXIT_DEVICE_ERROR, is_fatal_device_error

log = logging.getLogger(__name__)

POLL_MS = 500  # idle poll; between polls the worker checks that its parent is alive


def serve(worker, sock: zmq.Socket, parent: int) -> None:
    """Answer ops in arrival order; run idle work (precomputes, a drafter's own) only while nothing else waits.
    Returns when the process's parent is no longer `parent` (the coordinator died: do not linger as an orphan),
    checked whenever the worker has nothing to answer. What the worker raises (a lost device) ends it."""
    while True:
        if os.getppid() != parent:
            return
        if worker.has_idle_work and not sock.poll(0):
            worker.run_idle_work(stop=lambda: bool(sock.poll(0)))
            continue
        if not sock.poll(POLL_MS):
            continue
        frame = sock.recv()
        try:
            msg = P.decode(frame, P.WorkerOp)
        except P.ProtocolError as e:
            sock.send(P.encode(P.ErrorReply(-1, f"protocol error: {e}")))
            continue
        if isinstance(msg, P.Shutdown):
            sock.send(P.encode(P.Ack(msg.seq)))
            return
        sock.send(P.encode(worker.answer(msg)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spind.worker.main")
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", required=True, help="JSON dump of the coordinator's SpindConfig ('-': stdin)")
    ap.add_argument("--endpoint", required=True, help="ipc:// endpoint the coordinator bound for this worker")
    ap.add_argument("--probs-endpoint", required=True, help="ipc:// endpoint of the target's draft-probs channel")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--device", default=None, help="the device as this process sees it (default: the config's)")
    ap.add_argument("--group-devices", default=None,
                    help="a tensor-parallel target's devices, comma-separated, as this process sees them")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="the coordinator's PID: the worker exits once it is no longer its parent (default: its "
                         "parent at start)")
    args = ap.parse_args(argv)
    # The coordinator that started this process: watched while serving, so that a coordinator that dies (even while
    # the models load, or before this line ran: then the parent is already PID 1 or a subreaper) leaves no orphan
    parent = os.getppid() if args.parent_pid is None else args.parent_pid
    if os.getppid() != parent:
        return 0
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s worker[{args.name}] %(levelname)s %(message)s")
    import torch  # after argparse: a bad invocation fails fast

    from spind.worker.probs import ZmqProbsReceiver, ZmqProbsSender
    from spind.worker.worker import TARGET_WORKER, Worker

    torch.set_num_threads(max(1, args.threads))
    if args.config == "-":
        cfg = from_dict(json.load(sys.stdin))
    else:
        with open(args.config) as f:
            cfg = from_dict(json.load(f))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)
    if args.name == TARGET_WORKER:
        channel = ZmqProbsReceiver(ctx, args.probs_endpoint)
        group = args.group_devices.split(",") if args.group_devices else None
        worker = Worker(args.name, cfg, probs_in=channel, device=args.device, group_devices=group)
    else:
        channel = ZmqProbsSender(ctx, args.probs_endpoint)
        worker = Worker(args.name, cfg, probs_out=channel, device=args.device)
    sock.send(P.encode(worker.ready(torch.get_num_threads())))
    try:
        serve(worker, sock, parent)
    except Exception as e:
        if not is_fatal_device_error(e):
            raise
        # No clean-up: with the CUDA context broken, freeing its memory (torch's allocator, at exit) can hang too.
        log.critical("worker %s lost its device (%s: %s); exiting with %d to be restarted", args.name,
                     type(e).__name__, e, EXIT_DEVICE_ERROR)
        logging.shutdown()
        os._exit(EXIT_DEVICE_ERROR)
    finally:
        worker.close()
        channel.close()
        sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
