"""A tensor-parallel follower: one process of an engine rank's `--tp N` group other than its first.

    python -m pd.rank.tp_follower --tp-rank K --tp N --address HOST:PORT [--dp-rank I --dp D] --engine-config JSON

(`--dp-rank`/`--dp` under `--ep`: the group joins the world of every rank's processes, engine/parallel/world.py.)

Started by the group's first process (pd/rank/worker.py), which schedules; this one joins the group,
builds its share of the engine and runs the forwards the first process broadcasts
(engine/parallel/tensor_parallel.py) until it says stop. It dies with its parent (PR_SET_PDEATHSIG), and a
failed collective (a peer gone) ends it with an error: the parent's next collective fails too, the
parent exits and the server restarts the rank, followers and all.
"""

from __future__ import annotations

import argparse
import logging
import signal

from engine.checkpoints import load_progress
from engine.codec import from_wire
from engine.config import EngineConfig
from pd.config import LOG_FORMATS
from pd.http.request_log import install as install_logging
from pd.lifecycle import exit_now

log = logging.getLogger(__spec__.name)  # __name__ is "__main__" under python -m


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pd.rank.tp_follower")
    p.add_argument("--tp-rank", type=int, required=True, help="this process's place in the group (1..N-1)")
    p.add_argument("--tp", type=int, required=True, help="the group's size")
    p.add_argument("--address", required=True, help="the group's rendezvous (the first process hosts it)")
    p.add_argument("--dp-rank", type=int, default=None, help="--ep: the engine rank whose group this is; --address "
                   "is then the world's rendezvous (engine/parallel/world.py: engine rank 0's first process hosts it)")
    p.add_argument("--dp", type=int, default=1, help="--ep: the engine ranks of the world")
    p.add_argument("--engine-config", required=True, help="the EngineConfig as JSON (engine/codec.py), device resolved")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="the server's --log-format")
    args = p.parse_args(argv)
    from pd.rank.worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the rank's: it ends with its group, not on these
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.log_format == "json":
        install_logging("info", "json")
    else:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{args.tp_rank} %(levelname)s %(message)s")
    load_progress.configure(f"tp{args.tp_rank}", is_bar_allowed=args.log_format == "text")  # named as its log lines
    import json

    from engine.engine import LLMEngine
    from engine.parallel.tensor_parallel import init_group
    from engine.parallel.world import join_world, leave_world

    cfg = from_wire(EngineConfig, json.loads(args.engine_config))
    try:
        if args.dp_rank is None:
            tp = init_group(args.tp_rank, args.tp, args.address, cfg.torch_device())
        else:
            tp, _ = join_world(args.dp_rank, args.dp, args.tp_rank, args.tp, args.address, cfg.torch_device())
        LLMEngine(cfg, tp).follow()
    except BaseException:
        log.exception("tensor-parallel follower %d failed", args.tp_rank)
        return 1
    finally:
        leave_world()
    return 0


if __name__ == "__main__":
    exit_now(main())
