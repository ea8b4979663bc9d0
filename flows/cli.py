"""``neuron-flows``: the command line.

neuron-flows run CONFIG [--set k=v ...]        the whole pipeline as a Prefect flow
neuron-flows train CONFIG [--set k=v ...]      tokenize + train only (torchrun, no Prefect)
neuron-flows evaluate MODEL --config F [--set k=v ...]
                                               the evaluate step alone on a model directory
                                               (exit 3 when evaluate.gate is not met)
neuron-flows validate PATH [--quick]           check a checkpoint
neuron-flows consolidate CKPT OUT [-f ...]     checkpoint → Hugging Face model directory
                         [--merge]             (LoRA: peft adapter; --merge: base + adapters)
neuron-flows make-tiny DIR                     a tiny model, tokenizer and corpus, offline
neuron-flows serve [--port 4200]               local Prefect server + deployments + worker (UI)
neuron-flows join [--launch-file F]            a further node of a multi-node run (Kubernetes)
neuron-flows plan --model M --hardware KIND --nodes N --seq-len S --global-batch G [--json]
                  [--memory-fraction F] [--lora-r R [--lora-targets q_proj,v_proj]]
                                               rank parallel layouts: memory per rank, tokens/s
neuron-flows doctor [--device D] [--nproc N] [--nnodes N] [--config F] [--json]
                                               check this host for a job: stack, one rank, all
                                               ranks, a parity smoke against one CPU process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys


def _config(args):
    from neuron_flows.tasks.config import FinetuneConfig

    return FinetuneConfig.load(args.config, args.set)


def _preflight(config, *, check_upload: bool = False):
    """The pipeline's preflight step (``tasks.steps.preflight``), before anything starts; the config
    with every Hub name's revision resolved to a commit."""
    from neuron_flows.tasks import steps

    # A token in a Prefect Secret block is read, and the Hub checked with it, by the flow.
    check_upload = check_upload and not config.hub.token_secret
    return steps.preflight(config, hub_token=os.environ.get("HF_TOKEN"), check_upload=check_upload, warn=_say)


def cmd_run(args) -> int:
    config = _config(args)
    _temporary_server_settings(whole_process=args.whole_process)
    # The command starts the temporary server and torchrun's ranks at once, before Prefect is
    # imported, so that they start while this process imports the flow, runs the preflight,
    # tokenizes and plans; the train step hands the ranks their job. Called from Python
    # (``main(argv)``), Prefect starts its own server at the flow's first API call.
    from neuron_parallel.launch import start_ready_ranks

    ahead = TemporaryServer() if args.whole_process and not os.environ.get("PREFECT_API_URL") else None
    ready = start_ready_ranks(config.to_launch()) if args.whole_process else None
    try:
        temporary = _uses_temporary_server()
        if ahead is not None and not temporary:  # a profile names a server, or temporary servers are off
            ahead.stop()
            ahead = None
        _preflight(config, check_upload=True)
        from neuron_flows.flows.finetune import finetune

        with ahead.settings() if ahead is not None else contextlib.nullcontext():
            if ahead is not None:
                ahead.wait()
            try:
                result = finetune(config)
            finally:
                _send_logs_and_events()
                if temporary and ahead is None:
                    _stop_prefects_server()
    finally:
        if ready is not None:
            ready.close()  # still waiting if the run ended before its train step
        if ahead is not None:
            ahead.stop()
    print(f"run: {result['run_dir']}")
    print(f"consolidated: {result['consolidated']}")
    if not result.get("promoted", True):
        print(f"not promoted: {result['reason']}")
        return NOT_PROMOTED_EXIT
    return 0


NOT_PROMOTED_EXIT = 3
"""The exit code of ``run`` and ``evaluate`` when the model does not meet ``evaluate.gate``."""


def cmd_evaluate(args) -> int:
    """The evaluate step (``tasks.steps.evaluate``) on the model in ``args.model_dir``, with the
    config's evaluation, eval rows (tokenized as the run tokenizes them) and output folder; exit
    0 when the model meets the gate (or there is none), :data:`NOT_PROMOTED_EXIT` when not."""
    from pathlib import Path

    config = _config(args)
    if not Path(args.model_dir).is_dir():
        raise ValueError(f"{args.model_dir} is not a directory; give a model directory (a consolidated model)")
    if "{flow_run" in config.output.dir:  # no Prefect run here to name the directory after
        import time

        config = config.for_run(time.strftime("evaluate-%Y%m%d-%H%M%S"), "none")
    from neuron_flows.tasks import steps
    from neuron_parallel.run_files import EVALUATION_FILE

    steps.check_evaluation(config)
    eval_path = steps.tokenize(config, log=_say).eval_path if config.library("data").has_eval else None
    token = os.environ.get("HF_TOKEN")
    evaluation = steps.evaluate(config, args.model_dir, eval_path=eval_path, token=token, log=_say)
    print(f"evaluation: {Path(config.output.dir) / EVALUATION_FILE}")
    if not evaluation.promoted:
        print(f"not promoted: {evaluation.reason}")
        return NOT_PROMOTED_EXIT
    print(f"promoted: {evaluation.reason}")
    return 0


def _temporary_server_settings(*, whole_process: bool) -> None:
    """Settings of Prefect's temporary server (none of them matters to a server PREFECT_API_URL
    names), set in the environment before Prefect is first imported; a value already there is kept.

    - Its SQLite database is migrated on first start; on a busy 2-core machine that can take longer
      than Prefect's default 20 s wait.
    - Analytics off: it would report usage to Prefect over the network (and log an error where
      there is none).
    - For the command itself (``whole_process``: the environment ends with the run), no
      registration of block types at start: the server would import every installed Prefect
      collection (prefect-kubernetes: a second or more of CPU) to register block types a run never
      uses; a block it loads (``hub.token_secret``) was saved with its type. Memoizing the
      registration goes off with it, since the memo imports the collections to hash them before it
      reads the setting. ``prefect server start`` and ``neuron-flows serve`` register them as ever.
    """
    settings = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if whole_process:
        settings |= {
            "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
            "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",
        }
    for name, value in settings.items():
        os.environ.setdefault(name, value)


class TemporaryServer:
    """Prefect's temporary local server, for a run where no PREFECT_API_URL names a server: the
    process Prefect's ``SubprocessASGIServer`` starts (uvicorn serving the API of
    ``prefect.server.api.server:create_app`` on a free local port, no UI, the same database),
    started by the command before it imports Prefect, and named to the flow by
    :meth:`settings`. Started here rather than through ``SubprocessASGIServer`` because importing
    that class loads the whole server package into the command (~3 CPU-s on a 2-core machine, on
    the way to the first training step); the server's own process loads it anyway."""

    def __init__(self) -> None:
        import socket
        import subprocess

        from neuron_parallel.procs import die_with_parent

        with socket.socket() as s:  # a free port: the kernel's pick
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.api_url = f"http://127.0.0.1:{port}/api"
        print(f"Starting temporary server on http://127.0.0.1:{port} (no PREFECT_API_URL is set)", flush=True)
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent(os.getpid()))

    def wait(self) -> None:
        """Block until the server answers its health check; raise if it exits first or takes
        longer than PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS."""
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        from neuron_flows.flows.serve import wait_healthy

        wait_healthy(self.api_url, self.proc, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), poll_s=0.05)

    @contextlib.contextmanager
    def settings(self):
        """The context in which Prefect's clients use this server. Without flow-run heartbeats:
        they let a lasting server mark a run whose process died as Crashed, while this server ends
        with this process; and their thread, which sleeps in 1 s slices, holds up the end of the
        flow by up to a second. Without the link to the run's page, which this server (no UI,
        like Prefect's own temporary server) does not serve."""
        import logging

        from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        logging.getLogger("prefect.flow_runs").addFilter(_no_run_page_link)
        try:
            with temporary_settings(updates={PREFECT_API_URL: self.api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                yield
        finally:
            logging.getLogger("prefect.flow_runs").removeFilter(_no_run_page_link)

    def stop(self) -> None:
        """Stop the server now, rather than at interpreter exit, so that the run's summary lines
        are the last thing printed; also while it is still starting (a refused preflight)."""
        from neuron_parallel.procs import kill_tree

        kill_tree(self.proc, grace_s=5.0)


def _no_run_page_link(record) -> bool:
    """A logging filter (a callable, as ``logging`` takes): drops Prefect's "View at <run page>"."""
    return not str(record.msg).startswith("View at ")


def _uses_temporary_server() -> bool:
    """Whether the flow runs on a temporary server (no PREFECT_API_URL, temporary servers enabled)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def _stop_prefects_server() -> None:
    """Stop the temporary server Prefect started for the flow, if it started one, now rather than
    at interpreter exit."""
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer().stop()


def _send_logs_and_events(timeout_s: float = 30.0) -> None:
    """Send the logs and events the run has queued to the server, and wait until they are sent,
    before the server is stopped or this process exits (as Prefect's own test harness does). A
    task run's states reach the server as events; logs queued at interpreter exit for a server
    already stopped would be retried for a minute and then lost."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)


def cmd_train(args) -> int:
    config = _config(args)
    if "{flow_run" in config.output.dir:  # no Prefect run here to name the directory after
        import time

        config = config.for_run(time.strftime("train-%Y%m%d-%H%M%S"), "none")
    config = _preflight(config)
    from neuron_flows.tasks import steps
    from neuron_parallel.reporting import format_event

    dataset = steps.tokenize(config, log=_say)
    reference_path = steps.reference(config, dataset, log=_say)
    layout, _ = steps.plan(config, steps.model_dir(config), dataset.path, log=_say)
    steps.train(
        config,
        dataset,
        layout,
        reference_path=reference_path,
        on_event=lambda event: _say(format_event(event)),
        log=_say,
        on_line=lambda line: print(line, file=sys.stderr),
    )
    print(f"run: {config.output.dir}")
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_serve(args) -> int:
    from pathlib import Path

    from neuron_flows.flows.notify import webhook_url
    from neuron_flows.flows.serve import register_only, serve

    webhook_url()  # a webhook that may not carry notifications is refused before anything starts
    if args.register_only:
        return register_only()
    return serve(args.host, args.port, Path(args.home), worker=not args.no_worker)


def cmd_join(args) -> int:
    from neuron_parallel.launch import LAUNCH_FILE_ENV, join

    path = args.launch_file or os.environ.get(LAUNCH_FILE_ENV)
    if not path:
        raise ValueError(f"give --launch-file or set {LAUNCH_FILE_ENV} (the first node publishes the launch there)")
    result = join(path, timeout_s=args.timeout, on_line=lambda line: print(line, flush=True))
    print(f"run: {result.run_dir}")
    return 0


def cmd_validate(args) -> int:
    from neuron_parallel.checkpoint import resolve_checkpoint, validate_checkpoint

    problems = validate_checkpoint(args.path, quick=args.quick)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"ok: {resolve_checkpoint(args.path)}{' (sizes only)' if args.quick else ''}")
    return 0


def cmd_consolidate(args) -> int:
    from neuron_parallel.checkpoint.output import check_output_dir

    check_output_dir(args.output)  # someone else's folder is refused at once, before torch is imported
    from neuron_parallel.checkpoint import export_checkpoint

    options = {k: getattr(args, k) for k in ("max_shard_size", "model_dir", "base_dir")}
    kind = "merged" if args.merge else None
    out = export_checkpoint(args.checkpoint, args.output, kind=kind, fmt=args.format, **options)
    print(f"consolidated: {out}")
    return 0


def cmd_make_tiny(args) -> int:
    from neuron_parallel.tiny import make_tiny_world

    paths = make_tiny_world(args.dir, seed=args.seed)
    print("\n".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def cmd_plan(args) -> int:
    """Rank every layout; exit 0 when one fits, 1 when none does (the JSON says why)."""
    from neuron_parallel.config import LoraConfig
    from neuron_parallel.planning.search import format_table, search_layouts

    model = json.loads(args.model) if args.model.lstrip().startswith("{") else args.model
    lora = None
    if args.lora_r is not None:
        targets = {"target_modules": args.lora_targets.split(",")} if args.lora_targets else {}
        lora = LoraConfig(r=args.lora_r, **targets)
    elif args.lora_targets:
        raise ValueError("--lora-targets needs --lora-r (the adapters' rank), e.g. --lora-r 16")
    report = search_layouts(
        model,
        args.hardware,
        nodes=args.nodes,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        precision=args.precision,
        ranks_per_node=args.ranks_per_node,
        lora=lora,
        **({} if args.memory_fraction is None else {"memory_fraction": args.memory_fraction}),
    )
    print(json.dumps(report.to_dict()) if args.json else format_table(report, args.top))
    return 0 if report.feasible else 1


DOCTOR_FLAGS = (
    "doctor's --device, --nproc and --nnodes set launch.device, launch.nproc_per_node and launch.nnodes; without "
    "--config, NEURON_FLOWS_RDZV_ENDPOINT gives launch.rdzv_endpoint"
)


def cmd_doctor(args) -> int:
    """Exit 0 when every check passes, 1 when one fails (a device the host lacks, or bad input,
    is a ``ValueError``: exit 2)."""
    from neuron_flows.tasks import steps
    from neuron_flows.tasks.config import FinetuneConfig
    from neuron_flows.tasks.doctor import doctor_target
    from neuron_parallel.doctor import format_table, run_doctor, to_json

    flags = {"device": args.device, "nproc_per_node": args.nproc, "nnodes": args.nnodes}
    try:
        config = FinetuneConfig.load(args.config, [f"launch.{k}={v}" for k, v in flags.items() if v is not None])
        target = doctor_target(config, steps.plan, from_file=args.config is not None, work_dir=args.work_dir)
        checks = run_doctor(target)
    except ValueError as e:
        raise ValueError(f"{e} ({DOCTOR_FLAGS})") from None
    print(to_json(checks) if args.json else format_table(checks), flush=True)
    return 0 if all(c.ok for c in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-flows", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("run", cmd_run, "run the whole pipeline as a Prefect flow"),
        ("train", cmd_train, "tokenize and train only (torchrun, no Prefect)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "evaluate",
        help="the evaluate step alone: eval loss, generations and lm-eval tasks of a model directory, and "
        "evaluate.gate (exit 3 when not met); writes evaluation.json into output.dir",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a model directory (a consolidated model)")
    p.add_argument("--config", required=True, help="the run's YAML config (its evaluate, data and output sections)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(fn=cmd_evaluate)
    p = sub.add_parser("validate", help="check a checkpoint (run dir, checkpoint dir or shards/)")
    p.add_argument("path")
    p.add_argument("--quick", action="store_true", help="sizes only, no checksums or tensor reads")
    p.set_defaults(fn=cmd_validate)
    _add_consolidate(sub)
    _add_service(sub)
    _add_plan(sub)
    _add_doctor(sub)
    return parser


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this host for a job: torch and the device, one rank, collectives on every rank, and a "
        "3-step parity smoke against one CPU process",
    )
    p.add_argument("--device", choices=["cpu", "cuda", "neuron"], help="default: the config's launch.device, else cpu")
    p.add_argument("--nproc", type=int, help="ranks on this node (default: the config's launch.nproc_per_node, else 1)")
    p.add_argument("--nnodes", type=int, help="nodes of the job (default: the config's launch.nnodes, else 1)")
    p.add_argument("--config", help="the run's YAML config: its layout, model, shapes and output dir are checked for")
    p.add_argument(
        "--work-dir",
        help="where the parity smoke keeps its tiny model, data and runs (default .runs/doctor; on a volume every "
        "node mounts when --nnodes > 1)",
    )
    p.add_argument("--json", action="store_true", help='only JSON on stdout: {"checks": [{name, ok, detail, seconds}]}')
    p.set_defaults(fn=cmd_doctor)


def _add_consolidate(sub) -> None:
    p = sub.add_parser(
        "consolidate",
        help="write a Hugging Face model directory from a checkpoint (ours, or optimum-neuron / neuronx-distributed)",
    )
    p.add_argument("checkpoint", help="run dir (newest complete checkpoint), checkpoint dir, or its shards/")
    p.add_argument("output")
    p.add_argument("-f", "--format", choices=["safetensors", "pytorch"], default="safetensors")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument(
        "--model-dir",
        metavar="DIR",
        help="Hugging Face model dir whose config, generation config and "
        "tokenizer are copied (default: the checkpoint's own; for optimum-neuron checkpoints, the "
        "checkpoint dir or its parent)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoints: write the base model with the adapters merged in (default: the peft adapter)",
    )
    p.add_argument(
        "--base-dir",
        metavar="DIR",
        help="with --merge: the base model the adapters were trained on (default: the one the manifest records)",
    )
    p.set_defaults(fn=cmd_consolidate)


def _add_service(sub) -> None:
    """make-tiny, serve and join: the commands that set up a machine or a service."""
    p = sub.add_parser(
        "make-tiny", help="build tiny Llama and Qwen2 models, a tokenizer, a corpus and a wikitext-like folder, offline"
    )
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_make_tiny)
    p = sub.add_parser("serve", help="local Prefect server (127.0.0.1), work pools, deployments and a worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--home", default=".runs/prefect", help="PREFECT_HOME: the server's SQLite database and settings")
    p.add_argument("--no-worker", action="store_true", help="start no worker for the local pool")
    p.add_argument(
        "--register-only",
        action="store_true",
        help="register pools and deployments on the server at PREFECT_API_URL, then exit",
    )
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("join", help="wait for a multi-node launch published by the first node, and join it")
    p.add_argument("--launch-file", help="default $NEURON_FLOWS_LAUNCH_FILE")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds to wait for the launch")
    p.set_defaults(fn=cmd_join)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="rank parallel layouts of a model on some hardware (memory per rank, tokens/s)")
    p.add_argument(
        "--model",
        required=True,
        metavar="PATH_OR_CONFIG_JSON",
        help="model directory, its config.json, or the config as inline JSON (weights are never read)",
    )
    p.add_argument(
        "--hardware",
        required=True,
        help="trn2.48xlarge, trn3, trn1.32xlarge, p5.48xlarge, h200x8, "
        "cpu, or a hardware YAML file (neuron_parallel.planning.hardware)",
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument(
        "--precision",
        choices=["bf16", "fp32", "bf16_autocast"],
        default="bf16",
        help="bf16: bf16 weights and grads with fp32 master and Adam (the ZeRO paper's mixed precision); "
        "bf16_autocast: the trainer's parallel.mixed_precision bf16 (auto on cuda and neuron: fp32 states, "
        "bf16 autocast); fp32: its fp32 (auto on cpu). Compute is planned at the hardware's peak for that "
        "precision: bf16 matmuls for bf16 and bf16_autocast, fp32 (TF32 on CUDA) for fp32",
    )
    p.add_argument("--ranks-per-node", type=int, help="override the hardware's ranks per node (e.g. cpu)")
    p.add_argument(
        "--memory-fraction",
        type=float,
        help="share of a rank's memory a layout may fill (as launch.memory_fraction, whose default applies)",
    )
    p.add_argument("--lora-r", type=int, help="plan LoRA adapters of this rank on the frozen model (default: full)")
    p.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated projections that get adapters (default all 7: q_proj,...,down_proj)",
    )
    p.add_argument("--top", type=int, default=10, help="layouts shown in the table")
    p.add_argument("--json", action="store_true", help="every candidate as JSON: feasible, candidates (best first)")
    p.set_defaults(fn=cmd_plan)


_signalled: list[int] = []


def _stop_on(signum: int, frame) -> None:
    _signalled.append(signum)
    raise KeyboardInterrupt


EXIT_AT_ONCE = ("run", "train", "evaluate")
"""Commands that, run as the ``neuron-flows`` command, end the process as soon as they return."""


def main(argv: list[str] | None = None) -> int:
    """The command line. Called without ``argv`` (the ``neuron-flows`` command itself), ``run``
    starts Prefect's temporary server at once (``TemporaryServer``), and ``run`` and ``train`` end
    the process with their exit code as soon as they return (``os._exit``): what they made is on
    disk and their logs and events are on the server (``_send_logs_and_events``), and interpreter
    shutdown would only tear down torch, transformers and Prefect module by module, which takes
    seconds. Called with ``argv`` (from Python), every command returns its code and leaves the
    process's logging and its exit as they were."""
    args = build_parser().parse_args(argv)
    args.whole_process = argv is None
    # SIGTERM and SIGHUP (a `timeout`, a closed terminal, a scheduler) unwind like Ctrl-C, so the
    # launcher's cleanup ends torchrun and every rank before this process exits; their default
    # action would end this process alone and leave the ranks training.
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # SIGINT even where inherited ignored
        signal.signal(signum, _stop_on)
    try:
        code = args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        signum = _signalled[0] if _signalled else signal.SIGINT
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr)
        # Exit now: the ranks are gone (the launcher's cleanup ran while the interrupt unwound),
        # and Prefect's background threads, still trying to reach the server this run stopped,
        # would otherwise hold the interpreter open.
        _exit_now(128 + signum)
    if args.whole_process and args.command in EXIT_AT_ONCE:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
