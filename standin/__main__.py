"""`python3 -m standin serve [MODEL] [vLLM arguments]`.

Loading (port closed) lasts STANDIN_LOAD_SECONDS and prints vLLM's startup lines in order; then the
OpenAI-compatible API listens on --host/--port. Fault switches: standin/faults.py and `serve --help`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from standin import __version__, answers, faults, vlog
from standin.metrics import Stats
from standin.offload import OffloadRegion
from standin.server import Engine, Server

DEFAULT_MODEL = "standin/tiny-demo"
MODEL_MEMORY_GIB = 0.5
DRAFT_PARAMS = 96

FAULTS_HELP = """\
environment:
  STANDIN_LOAD_SECONDS=S     loading lasts S seconds, the port closed (default 2)
  STANDIN_CRASH_AFTER_S=S    exit with status 1 after S seconds of serving (the mmap file is removed)
  STANDIN_CRASH_LEAVE_MMAP=1 the crash is an os._exit that leaves the mmap file behind
  STANDIN_HANG_AFTER_S=S     after S seconds of serving, accept connections but never answer
  STANDIN_DEADLOCK_AFTER_S=S the engine core deadlocks: /health, /v1/models, /metrics 200,
                             completions held unanswered, token counters frozen, waiting grows
  STANDIN_ENGINE_DEAD_AFTER_S=S  the engine core is dead, the server up: /health 503,
                             completions 500 with EngineDeadError's body
  STANDIN_COLLAPSE_AFTER_S=S tokens at STANDIN_COLLAPSE_FACTOR (default 0.01) times the rate
  STANDIN_GPU_FAULT_AFTER_S=S  ROCm's "Memory access fault by GPU node-N ..." line, then SIGABRT
  STANDIN_<KIND>_AFTER_REQUESTS=N  the same after N completion requests (0: from the first)
  STANDIN_NEVER_READY=1      stay loading forever (stops before CUDA graph capture)
  STANDIN_KV_CACHE_TOKENS=N  report a GPU KV cache of N tokens (default 65536)
  STANDIN_TOKEN_SECONDS=S    delay between generated tokens (default 0)
  STANDIN_FAULTS_FILE=PATH   a JSON object with the same names, lower-case without STANDIN_
                             (e.g. {"deadlock_after_s": 30}); read at start, wins over the
                             variables, a missing file is fine; read again whenever it changes
                             while serving (each switch then counted from that moment)
  STANDIN_SHM_DIR=DIR        where the KV offload mmap file is created (default /dev/shm)

Each fault's public source: standin/faults.py (SOURCES) and docs/testing.md.
"""


class _Stop(Exception):

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop(signum)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m standin",
        description="A stand-in for vLLM's OpenAI-compatible server: no GPU, no model, deterministic answers.",
    )
    parser.add_argument("--version", action="version", version=f"standin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the API like `vllm serve`",
        usage="python3 -m standin serve [MODEL] [--host HOST] [--port PORT] [--served-model-name NAME ...] "
        "[--kv-offloading-size GIB] [--max-model-len N] [other vLLM arguments, accepted and ignored]",
        description="Serve like `vllm serve MODEL ...`; vLLM arguments not listed here are accepted and ignored.",
        epilog=FAULTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    serve.add_argument("--model", help="the model (also accepted as the first argument)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--served-model-name", nargs="+", help="model name(s) in the API (default: the model)")
    serve.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                       help="CPU KV offload size in GiB: an mmap file of this size in STANDIN_SHM_DIR")
    serve.add_argument("--max-model-len", type=int, default=4096, help="context length (default 4096)")
    return parser


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def _load(args: argparse.Namespace, cfg: faults.Faults, model: str, shm_dir: Path) -> OffloadRegion | None:
    """The loading phase: vLLM's startup lines in order, spread over cfg.load_seconds."""
    start = time.monotonic()

    def at(fraction: float) -> None:
        _sleep_until(start + fraction * cfg.load_seconds)

    api = vlog.API
    vlog.log("entrypoints/openai/api_server.py:1822", f"vLLM API server version {__version__}+standin", proc=api)
    shown = {k: v for k, v in vars(args).items() if v is not None and k != "command"}
    vlog.log("entrypoints/utils.py:233", f"non-default args: {shown}", proc=api)
    vlog.log("standin/__main__.py:1", f"stand-in answers in effect: {answers.VARIANT}", proc=api)
    at(0.05)
    vlog.log("v1/worker/gpu_model_runner.py:2547", f"Starting to load model {model}...")
    at(0.40)
    took = time.monotonic() - start
    vlog.log("model_executor/model_loader/default_loader.py:267", f"Loading weights took {took:.2f} seconds")
    vlog.log("v1/worker/gpu_model_runner.py:2598",
             f"Model loading took {MODEL_MEMORY_GIB:.4f} GiB and {took:.6f} seconds")
    at(0.45)
    vlog.log("v1/worker/gpu/spec_decode/dspark/speculator.py:112", f"DSpark draft model loaded: {DRAFT_PARAMS} params")
    at(0.60)
    kv_tokens = cfg.kv_cache_tokens
    vlog.log("v1/worker/gpu_worker.py:306", f"Available KV cache memory: {kv_tokens * 70 / 2**20:.2f} GiB")
    vlog.log("v1/core/kv_cache_utils.py:1087", f"GPU KV cache size: {kv_tokens:,} tokens")
    vlog.log("v1/core/kv_cache_utils.py:1091", f"Maximum concurrency for {args.max_model_len:,} tokens per request: "
             f"{kv_tokens / args.max_model_len:.2f}x")
    at(0.70)
    region = None
    size = int(args.kv_offloading_size * 2**30)
    if size > 0:
        region = OffloadRegion(shm_dir, size)
        vlog.log("v1/kv_offload/cpu/shared_offload_region.py:68",
                 f"Created mmap file {region.path} ({region.size_gb:.2f} GB)")
    try:
        at(0.75)
        if cfg.never_ready:
            while True:
                time.sleep(3600)
        at(0.90)
        vlog.raw("Capturing CUDA graphs (decode, FULL): 100%|██████████| 35/35 [00:00<00:00, 87.50it/s]")
        vlog.log("v1/worker/gpu_model_runner.py:3388", "Graph capturing finished in 1 secs, took 0.00 GiB")
        at(1.0)
        vlog.log("v1/engine/core.py:210", "init engine (profile, create kv cache, warmup model) took "
                 f"{time.monotonic() - start:.2f} seconds")
    except BaseException:
        if region is not None:
            region.close()
        raise
    return region


def _crash(engine_server: Server, leave_mmap: bool, crashed: threading.Event) -> None:
    vlog.log("v1/engine/core.py:710", "EngineCore encountered a fatal error.", level="ERROR")
    vlog.log("v1/engine/async_llm.py:480", "AsyncLLM output_handler failed.", level="ERROR", proc=vlog.API)
    if leave_mmap:
        sys.stdout.flush()
        os._exit(1)  # like a killed EngineCore: nothing is cleaned up
    crashed.set()
    threading.Thread(target=engine_server.shutdown, daemon=True).start()


def gpu_fault_line(replica: int) -> str:
    """The line ROCm's runtime prints on stderr for a GPU memory access fault, as it appears in
    ROCm/pytorch#797 and ROCm/legacy-rocm-build#5051: on an MI300X host GPU nodes start at 2 (the
    CPUs are nodes 0 and 1); the agent handle and the address are process addresses."""
    handle = 0x55F1C4C0B370 + replica * 0x1000
    address = 0x7F2B0C000000 + replica * 0x200000
    return (f"Memory access fault by GPU node-{2 + replica} (Agent handle: {handle:#x}) on address {address:#x}. "
            "Reason: Page not present or supervisor privilege.")


def _gpu_fault() -> None:
    """The HSA runtime's fault handler: its line, then abort() (SIGABRT); nothing is cleaned up."""
    vlog.raw(gpu_fault_line(int(os.environ.get("APPLIANCE_REPLICA") or 0)))
    sys.stdout.flush()
    os.abort()


class _ProcessFaults:
    """Ends the process once for the fault kind that asks (crash, gpu_fault), from whichever thread
    notices it first."""

    def __init__(self, server: Server, armed: faults.Armed) -> None:
        self.server = server
        self.armed = armed
        self.crashed = threading.Event()
        self._once = threading.Lock()

    def __call__(self, kind: str) -> None:
        if not self._once.acquire(blocking=False):
            return
        if kind == "gpu_fault":
            _gpu_fault()
        _crash(self.server, self.armed.faults.crash_leave_mmap, self.crashed)


def _watch(engine: Engine, watcher: faults.Watcher, stop: threading.Event) -> None:
    """The faults' clock: the faults file read again when it changes, each switch's time looked at."""
    while not stop.wait(0.1):
        watcher.poll()
        engine.mode()


def _faults_changed(cfg: faults.Faults) -> None:
    on = {k: v for k, v in vars(cfg).items() if v != getattr(faults.Faults(), k) and k not in faults.START_ONLY}
    vlog.log("standin/faults.py:1", f"stand-in faults now: {on or 'none'}", proc=vlog.API)


def _faults_unreadable(message: str) -> None:
    vlog.log("standin/faults.py:1", f"stand-in faults unchanged: {message}", level="WARNING", proc=vlog.API)


def serve(args: argparse.Namespace) -> int:
    seen = faults.file_stamp(os.environ.get("STANDIN_FAULTS_FILE"))
    try:
        cfg = faults.load()
    except faults.FaultsError as e:
        print(f"standin: {e}", file=sys.stderr)
        return 2
    model = args.model or DEFAULT_MODEL
    names = args.served_model_name or [model]
    shm_dir = Path(os.environ.get("STANDIN_SHM_DIR", "/dev/shm"))
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    region: OffloadRegion | None = None
    server: Server | None = None
    stop_watching = threading.Event()
    try:
        region = _load(args, cfg, model, shm_dir)
        stats = Stats(model_name=names[0], kv_cache_tokens=cfg.kv_cache_tokens)
        armed = faults.Armed(cfg)
        engine = Engine(served_names=names, root=model, max_model_len=args.max_model_len, stats=stats, armed=armed)
        try:
            server = Server(args.host, args.port, engine)
        except OSError as e:
            vlog.log("entrypoints/openai/api_server.py:1880", f"cannot listen on {args.host}:{args.port}: {e}",
                     level="ERROR", proc=vlog.API)
            return 1
        host, port = str(server.server_address[0]), int(server.server_address[1])
        vlog.log("entrypoints/openai/api_server.py:1895", f"Starting vLLM API server 0 on http://{host}:{port}",
                 proc=vlog.API)
        vlog.uvicorn(f"Started server process [{os.getpid()}]")
        vlog.uvicorn("Waiting for application startup.")
        process_faults = _ProcessFaults(server, armed)
        engine.on_process_fault = process_faults
        armed.restart_clock()
        vlog.uvicorn("Application startup complete.")
        watcher = faults.Watcher(armed, os.environ, _faults_changed, _faults_unreadable, seen)
        threading.Thread(target=_watch, args=(engine, watcher, stop_watching), daemon=True).start()
        server.serve_forever(poll_interval=0.2)
        return 1 if process_faults.crashed.is_set() else 0
    except _Stop:
        vlog.uvicorn("Shutting down")
        vlog.uvicorn(f"Finished server process [{os.getpid()}]")
        return 0
    finally:
        stop_watching.set()
        if server is not None:
            server.server_close()
        if region is not None:
            region.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Take `serve MODEL` here, so that an ignored option's value is never mistaken for the model.
    model = None
    if len(argv) >= 2 and argv[0] == "serve" and not argv[1].startswith("-"):
        model = argv.pop(1)
    args, _ignored = parser.parse_known_args(argv)
    if model is not None:
        args.model = model
    if args.command == "serve":
        return serve(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
