"""Benchmark: our tokenize step (``neuron_parallel.data.tokenize_data``) against raw ``tokenizers``
batch encoding of the same texts on the same cores. Goal: ours >= 0.8x the baseline's throughput.

    .venv/bin/python bench/tokenization.py [--quick] [--size-mb 20] [--chat-size-mb 5] [--repeats 3]
                                           [--threads N] [--block-size 1024] [--num-proc N]
                                           [--profile auto|always|never] [--cases text,chat,preference]
                                           [--workdir DIR] [--keep]

Inputs, built offline and untimed: the tiny world (``neuron_parallel.tiny.make_tiny_world``; its
byte-level BPE tokenizer in ``model/``), then
  - text: the pydoc corpus (``corpus_documents()``) repeated to ``--size-mb`` MB of text, one
    document per JSONL row;
  - chat: the world's ``chat.jsonl`` (300 multi-turn conversations) repeated to ``--chat-size-mb``;
  - preference: one conversational pair per conversation of that chat set: the prompt its messages
    before its last assistant turn, chosen that turn (a message list), rejected the last assistant
    turn of the next conversation (a string).

Cases and what each timed region holds:
  1. text, stream packing: ``DataConfig(source=text.jsonl, format="text", block_size=B)``.
  2. chat, packed by document: ``DataConfig(source=chat.jsonl, format="chat",
     chat_template=<world>/chat_templates/llama3.jinja, block_size=B)`` (the Llama 3 template
     of ``neuron_parallel/chat_templates``, as ``make_tiny_world`` copies it).
  3. preference, pairs packed by document: ``DataConfig(source=pairs.jsonl, format="preference",
     chat_template=<the same>, block_size=B)``.
  - ours: the whole ``tokenize_data(DataConfig(..., cache_dir=<fresh dir>), model_dir,
    num_proc=--num-proc)`` call: fingerprint, tokenizer load, reading the JSONL (pyarrow for a
    source ``neuron_parallel.sources.encodes_here``, else ``datasets``), rendering and masking
    (chat), tokenizing, packing, the audit and saving the rows. ``datasets``' own
    cache (HF_DATASETS_CACHE, where the JSONL's table is kept too) is a fresh directory too, so
    nothing is reused.
    Imports, one load of the tokenizer (transformers imports its modules on first use) and one
    ``load_dataset`` of a one-line file (``datasets`` imports its modules on its first load) happen
    before the timed region.
  - baseline: only ``Tokenizer.from_file(model/tokenizer.json).encode_batch(texts,
    add_special_tokens=False)`` over exactly the texts ours tokenizes: the documents (text), the
    rendered conversations (chat), or each pair's prompt rendered with the generation prompt and
    what rendering prompt + chosen and prompt + rejected adds to it (preference). The texts are
    read, and for chat and preference rendered with ``AutoTokenizer.apply_chat_template(messages,
    tokenize=False, chat_template=<llama3.jinja>)``, before the timed region, and the tokenizer is
    loaded before it too: the baseline is given file reading, rendering and output for free (the
    render time is reported, not counted).

Method: every measurement runs in its own subprocess (``bench_util.run_child``), pinned to the same
cores with the same thread settings (``RAYON_NUM_THREADS=--threads``, tokenizers' parallelism on
when threads > 1, ``OMP_NUM_THREADS``), so neither warms the other. Both use every one of those
cores: the baseline through the tokenizer's threads in one process; ours as ``tokenize_data``
chooses with ``--num-proc`` unset (``neuron_parallel.sources.encodes_here``): in one process with
the tokenizer's threads on fewer than five cores (every case at the default sizes, up to 256 MB),
else for a source under 16 MB, and otherwise in a pool of one worker per core, each encoding on
one. For each repeat and case the
two alternate (baseline first on even repeats, ours first on odd ones), and the table reports
medians. Ratio = baseline seconds / our seconds = our tokens/s / baseline tokens/s over the same
texts; for information the table adds the ratio of CPU seconds (all threads, ``getrusage``), which
other load on the machine disturbs less, and each run records how long its threads waited,
runnable, for a core (``/proc/self/task/*/schedstat``, the main process only): the other load it met. Token counts are
checked to agree: ours counts one EOS per text document more (the stream ends each document with
EOS); chat adds none; preference counts each prompt twice (a pair is two documents, prompt +
chosen and prompt + rejected). When a case misses the goal (or with ``--profile always``), one more run of
ours under cProfile (not in the table) shows where its time goes.
Prints the table, the load average before and after, cores and threads; writes
bench/results/tokenization.json. ``--quick``: 1 MB of text, 0.5 MB of chat, one repeat, no profile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from bench_util import (
    RESULTS,
    loadavg,
    log,
    median,
    parser,
    pick,
    print_table,
    run_child,
    thread_waits_ns,
    verdict,
    work_dir,
    write_results,
)

GOAL = 0.8
CASES = ("text", "chat", "preference")
HOTSPOTS = (  # (label, file fragment, function): cumulative times pulled out of the profile
    ("fingerprint (sha256 of sources)", "neuron_parallel/data.py", "dataset_fingerprint"),
    ("tokenizer load", "transformers/tokenization_utils_base.py", "from_pretrained"),
    ("read source", "neuron_parallel/sources.py", "load_raw"),
    ("examples (encode; held-out split)", "neuron_parallel/data.py", "_split_examples"),
    ("  Encoder (render+tokenize+mask)", "neuron_parallel/sft.py", "encode_dataset"),
    ("  PairEncoder (render+tokenize)", "neuron_parallel/pairs.py", "encode_dataset"),
    ("    waiting for the encoding thread", "~", "acquire"),
    ("    Renderer.chats (renders, spans)", "neuron_parallel/sft.py", "chats"),
    ("      ChatRenderer.render_cuts (layouts)", "neuron_parallel/chat.py", "render_cuts"),
    ("      ChatRenderer.render (Jinja)", "neuron_parallel/chat.py", "render"),
    ("      ChatRenderer.cut_lengths (read)", "neuron_parallel/chat.py", "cut_lengths"),
    ("      apply_chat_template", "transformers/tokenization_utils_base.py", "apply_chat_template"),
    ("    tokenizer call (transformers)", "transformers/tokenization_utils_fast.py", "_batch_encode_plus"),
    ("    tokenizer call (transformers)", "transformers/tokenization_utils_tokenizers.py", "_encode_plus"),
    ("      encode_batch (Rust)", "~", "encode_batch"),
    ("      Encodings -> Python lists", "transformers/tokenization_utils_tokenizers.py", "_convert_encoding"),
    ("    masked_table (mask, Arrow lists)", "neuron_parallel/sft.py", "masked_table"),
    ("    in_spans (mask)", "neuron_parallel/sft.py", "in_spans"),
    ("  datasets map (a source not encoded in this process)", "datasets/arrow_dataset.py", "map"),
    ("rows (pack)", "neuron_parallel/data.py", "_rows"),
    ("  stream_rows", "neuron_parallel/packing.py", "stream_rows"),
    ("  document_rows", "neuron_parallel/packing.py", "document_rows"),
    ("  pair_rows", "neuron_parallel/pairs.py", "pair_rows"),
    ("    _greedy (per-document loop)", "neuron_parallel/packing.py", "_greedy"),
    ("audit", "neuron_parallel/audit.py", "build_audit"),
    ("save_rows (rows in memory)", "neuron_parallel/data.py", "save_rows"),
    ("save_to_disk", "datasets/arrow_dataset.py", "save_to_disk"),
)

# --------------------------------------------------------------------------------------------
# The child: one measurement in a fresh process


def _cpu_s() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _waited_s(before: dict[str, int]) -> float:
    """Seconds this process's threads waited for a core since ``before`` (threads that ended are lost)."""
    return sum(ns - before.get(tid, 0) for tid, ns in thread_waits_ns().items()) / 1e9


def _setup(spec: dict) -> None:
    """Threads, cores and a fresh ``datasets`` cache, before anything reads them."""
    threads = spec["threads"]
    os.environ.update(
        TOKENIZERS_PARALLELISM="true" if threads > 1 else "false",
        RAYON_NUM_THREADS=str(threads),
        OMP_NUM_THREADS=str(threads),
        HF_DATASETS_CACHE=spec["hf_cache"],
    )
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec["cores"])


def _data_config(spec: dict):
    from neuron_parallel.config import DataConfig

    case = spec["case"]
    return DataConfig(
        source=spec["source"],
        format=case,
        chat_template=spec["chat_template"] if case != "text" else None,
        block_size=spec["block_size"],
        cache_dir=spec["cache_dir"],
    )


def child_ours(spec: dict) -> dict:
    """``tokenize_data`` once, timed as a whole (optionally under cProfile)."""
    import cProfile

    from datasets import load_dataset  # (imports are not part of the timed region)
    from transformers import AutoTokenizer

    from neuron_parallel.data import tokenize_data

    # transformers and datasets import modules lazily, on first use: one untimed use pays for that.
    AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    warm = Path(spec["hf_cache"]).parent / "warm"
    warm.mkdir()
    (warm / "one.jsonl").write_text('{"text": "warm"}\n')
    load_dataset("json", data_files=str(warm / "one.jsonl"), split="train", cache_dir=str(warm / "cache"))
    data = _data_config(spec)
    prof = cProfile.Profile() if spec.get("profile") else None
    c0, w0, t0 = _cpu_s(), thread_waits_ns(), time.perf_counter()
    if prof:
        prof.enable()
    ds = tokenize_data(data, spec["tokenizer_dir"], num_proc=spec["num_proc"])
    if prof:
        prof.disable()
    seconds, cpu, waited = time.perf_counter() - t0, _cpu_s() - c0, _waited_s(w0)
    audit = {k: v for k, v in ds.audit.items() if k != "sample"}
    res = {
        "seconds": seconds,
        "cpu_s": cpu,
        "waited_s": waited,
        "tokens": ds.num_tokens,
        "rows": ds.num_blocks,
        "audit": audit,
    }
    if prof:
        res["profile"] = _profile_summary(prof, seconds)
    return res


def _texts(spec: dict) -> tuple[list[str], int, float]:
    """The texts ours tokenizes, how many of them are prompts (preference: the first ones), and the
    seconds spent rendering them (chat, preference)."""
    with open(spec["source"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if spec["case"] == "text":
        return [r["text"] for r in rows], 0, 0.0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    template = Path(spec["chat_template"]).read_text()

    def render(messages, generation=False):
        return tok.apply_chat_template(
            messages, tokenize=False, chat_template=template, add_generation_prompt=generation
        )

    t0 = time.perf_counter()
    if spec["case"] == "chat":
        return [render(r["messages"]) for r in rows], 0, time.perf_counter() - t0
    heads = [render(r["prompt"], True) for r in rows]
    completions = [
        render(r["prompt"] + (r[key] if isinstance(r[key], list) else [{"role": "assistant", "content": r[key]}]))[
            len(head) :
        ]
        for key in ("chosen", "rejected")
        for r, head in zip(rows, heads)
    ]
    return heads + completions, len(heads), time.perf_counter() - t0


def child_baseline(spec: dict) -> dict:
    """``encode_batch`` of the texts once; reading, rendering and loading happen before the clock."""
    from tokenizers import Tokenizer

    texts, prompts, render_s = _texts(spec)
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(Path(spec["tokenizer_dir"]) / "tokenizer.json"))
    load_s = time.perf_counter() - t0
    c0, w0, t0 = _cpu_s(), thread_waits_ns(), time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    seconds, cpu, waited = time.perf_counter() - t0, _cpu_s() - c0, _waited_s(w0)
    tokens = sum(len(e.ids) for e in encodings)
    return {
        "prompt_tokens": sum(len(e.ids) for e in encodings[:prompts]),
        "seconds": seconds,
        "cpu_s": cpu,
        "waited_s": waited,
        "tokens": tokens,
        "texts": len(texts),
        "render_s": render_s,
        "load_s": load_s,
    }


def _profile_summary(prof, total: float, top: int = 25) -> dict:
    """Top functions by own and cumulative time, and the cumulative time of the steps in HOTSPOTS."""
    import io
    import pstats

    stats = pstats.Stats(prof)
    tables = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        tables[key] = buf.getvalue().split("   ncalls", 1)[-1].join(["   ncalls", ""])
    steps = []
    for label, fragment, name in HOTSPOTS:
        found = [
            v[3]
            for (path, _, fn), v in stats.stats.items()
            if path.endswith(fragment) and (fn == name or (path == "~" and f"'{name}'" in fn))
        ]
        if found:
            steps.append({"step": label, "cumulative_s": max(found), "fraction": max(found) / total})
    return {"total_s": total, "steps": steps, "top_tottime": tables["tottime"], "top_cumulative": tables["cumulative"]}


def child_main(argv: list[str]) -> None:
    """``--child ours|baseline SPEC.json``: one measurement; its result goes to ``spec["result"]``."""
    kind, spec = argv[0], json.loads(Path(argv[1]).read_text())
    _setup(spec)
    res = child_ours(spec) if kind == "ours" else child_baseline(spec)
    Path(spec["result"]).write_text(json.dumps(res))


# --------------------------------------------------------------------------------------------
# The parent: build the inputs, alternate the measurements, report


def build_inputs(work: Path, size_mb: float, chat_size_mb: float) -> dict:
    """The tiny world, the text corpus and the chat set at the requested sizes (untimed)."""
    from neuron_parallel.tiny import TEMPLATES, corpus_documents, make_tiny_world

    world = make_tiny_world(work / "world")
    # The world's copy of the Llama 3 template where it makes one, else the library's own.
    template = Path(world.get("chat_templates", TEMPLATES)) / "llama3.jinja"
    docs = corpus_documents()
    reps = max(1, round(size_mb * 1e6 / sum(len(d.encode()) for d in docs)))
    text = work / "text.jsonl"
    with text.open("w") as f:
        for _ in range(reps):
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    lines = Path(world["chat"]).read_text().splitlines(keepends=True)
    chat_reps = max(1, round(chat_size_mb * 1e6 / sum(len(x.encode()) for x in lines)))
    chat = work / "chat.jsonl"
    chat.write_text("".join(lines) * chat_reps)
    pairs = work / "pairs.jsonl"
    pair_lines = _pairs([json.loads(x)["messages"] for x in lines])
    pairs.write_text("".join(pair_lines) * chat_reps)
    return {
        "tokenizer_dir": world["model"],
        "chat_template": str(template),
        "text": {"source": str(text), "documents": len(docs) * reps, "file_mb": text.stat().st_size / 1e6},
        "chat": {"source": str(chat), "documents": len(lines) * chat_reps, "file_mb": chat.stat().st_size / 1e6},
        "preference": {
            "source": str(pairs),
            "documents": len(pair_lines) * chat_reps,
            "file_mb": pairs.stat().st_size / 1e6,
        },
        "text_mb": reps * sum(len(d.encode()) for d in docs) / 1e6,
    }


def _pairs(conversations: list[list[dict]]) -> list[str]:
    """One JSONL line per conversation: the messages before its last assistant turn as the prompt,
    that turn (a message list) as chosen, the next conversation's last assistant turn (a string)
    as rejected."""
    out = []
    for i, messages in enumerate(conversations):
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        other = conversations[(i + 1) % len(conversations)]
        rejected = next(m["content"] for m in reversed(other) if m["role"] == "assistant")
        row = {"prompt": messages[:last], "chosen": [messages[last]], "rejected": rejected}
        out.append(json.dumps(row) + "\n")
    return out


class Runner:
    """Starts the measurements, each in its own subprocess with fresh scratch directories."""

    def __init__(self, work: Path, inputs: dict, args: argparse.Namespace, cores: list[int]) -> None:
        self.work, self.inputs, self.args, self.cores = work, inputs, args, cores
        self.count = 0

    def measure(self, kind: str, case: str, *, profile: bool = False) -> dict:
        """One measurement in its own subprocess; its scratch directories are removed after."""
        self.count += 1
        scratch = self.work / f"run-{self.count}-{kind}-{case}"
        scratch.mkdir()
        spec = {
            "case": case,
            "source": self.inputs[case]["source"],
            "tokenizer_dir": self.inputs["tokenizer_dir"],
            "chat_template": self.inputs["chat_template"],
            "block_size": self.args.block_size,
            "num_proc": self.args.num_proc,
            "threads": self.args.threads,
            "cores": self.cores,
            "cache_dir": str(scratch / "cache"),
            "hf_cache": str(scratch / "hf_datasets_cache"),
            "result": str(scratch / "result.json"),
            "profile": profile,
        }
        (scratch / "spec.json").write_text(json.dumps(spec))
        load = os.getloadavg()[0]
        cmd = [sys.executable, __file__, "--child", kind, str(scratch / "spec.json")]
        wall, _ = run_child(cmd, threads=self.args.threads, timeout=900, label=f"{kind} {case}")
        res = json.loads(Path(spec["result"]).read_text())
        shutil.rmtree(scratch, ignore_errors=True)
        res.update(kind=kind, case=case, process_wall_s=wall, loadavg_1min_before=load)
        if not profile:
            log(
                f"{case:<5} {kind:<8} {res['seconds']:7.2f}s  cpu {res['cpu_s']:6.2f}s  "
                f"waited {res['waited_s']:5.2f}s  {res['tokens']:>11,} tokens  "
                f"(process {wall:.1f}s, load {load:.2f})"
            )
        return res


def summarise(case: str, runs: list[dict], documents: int) -> dict:
    """The medians of one case's runs, their ratio against the goal and the token check."""
    base = [r for r in runs if r["case"] == case and r["kind"] == "baseline"]
    ours = [r for r in runs if r["case"] == case and r["kind"] == "ours"]
    base_s, ours_s = median([r["seconds"] for r in base]), median([r["seconds"] for r in ours])
    base_tokens, ours_tokens = base[0]["tokens"], ours[0]["tokens"]
    # The stream's EOS after every text document; a pair's prompt written in both its documents.
    extra = {"text": documents, "preference": base[0]["prompt_tokens"]}.get(case, 0)
    ratio = base_s / ours_s
    return {
        "baseline_s": base_s,
        "ours_s": ours_s,
        "baseline_s_all": [r["seconds"] for r in base],
        "ours_s_all": [r["seconds"] for r in ours],
        "baseline_cpu_s": median([r["cpu_s"] for r in base]),
        "ours_cpu_s": median([r["cpu_s"] for r in ours]),
        "baseline_waited_s": median([r["waited_s"] for r in base]),
        "ours_waited_s": median([r["waited_s"] for r in ours]),
        "baseline_tokens": base_tokens,
        "ours_tokens": ours_tokens,
        "expected_extra_eos": extra,
        "tokens_agree": ours_tokens - base_tokens == extra and len({r["tokens"] for r in base + ours}) <= 2,
        "baseline_tokens_per_s": base_tokens / base_s,
        "ours_tokens_per_s": base_tokens / ours_s,
        "render_s": median([r["render_s"] for r in base]),
        "ratio": ratio,
        "cpu_ratio": median([r["cpu_s"] for r in base]) / median([r["cpu_s"] for r in ours]),
        "goal": GOAL,
        "met": ratio >= GOAL,
        "audit": ours[0]["audit"],
    }


def print_report(report: dict) -> None:
    s, inp = report["summary"], report["inputs"]
    print()
    print(
        f"inputs: text {inp['text_mb']:.1f} MB ({inp['text']['documents']:,} documents), chat "
        f"{inp['chat']['file_mb']:.1f} MB JSONL ({inp['chat']['documents']:,} conversations), preference "
        f"{inp['preference']['file_mb']:.1f} MB JSONL ({inp['preference']['documents']:,} pairs); block_size "
        f"{report['args']['block_size']}, num_proc {report['args']['num_proc']}"
    )
    h = report["host"]
    print(
        f"cores {h['cores_used']} of {h['cpus']} (pinned {h['cores_pinned']}), threads {h['threads']}; "
        f"load average (1/5/15 min) before {h['loadavg_before']} -> after {h['loadavg_after']}; "
        f"{report['args']['repeats']} repeats, medians"
    )
    print()
    names = {"text": "text (stream)", "chat": "chat (documents)", "preference": "preference (pairs)"}
    rows = [
        [names[case], f"{r['baseline_s']:.2f}", f"{r['ours_s']:.2f}", f"{r['baseline_tokens']:,}"]
        + [f"{r['baseline_tokens_per_s'] / 1e6:.2f}", f"{r['ours_tokens_per_s'] / 1e6:.2f}", f"{r['ratio']:.2f}x"]
        + [f">= {GOAL}x", verdict(r["met"]), f"{r['cpu_ratio']:.2f}x"]
        for case, r in s.items()
    ]
    headers = ["case", "baseline s", "ours s", "tokens", "base Mtok/s", "ours Mtok/s", "ratio", "goal", "met?"]
    print_table([*headers, "cpu ratio"], rows)
    print(
        "ratio = baseline s / ours s (the goal); cpu ratio (info) = baseline / ours CPU seconds of all threads, "
        "less disturbed by other load but blind to how well the cores are used"
    )
    print()
    for case, r in s.items():
        print(
            f"{case}: tokens baseline {r['baseline_tokens']:,}, ours {r['ours_tokens']:,} (+{r['expected_extra_eos']:,}"
            f" expected): {'agree' if r['tokens_agree'] else 'DISAGREE'}; cpu s baseline {r['baseline_cpu_s']:.2f}"
            f", ours {r['ours_cpu_s']:.2f}; waited for a core s baseline {r['baseline_waited_s']:.2f}, ours "
            f"{r['ours_waited_s']:.2f}; runs baseline {_fmt(r['baseline_s_all'])}, ours {_fmt(r['ours_s_all'])}"
        )
    for case, what in (("chat", "one render per conversation"), ("preference", "three renders per pair")):
        if case in s:
            r = s[case]
            print(
                f"{case}: the baseline is given rendering for free ({r['render_s']:.2f}s, {what}); "
                f"counted in, the ratio would be {(r['baseline_s'] + r['render_s']) / r['ours_s']:.2f}x"
            )


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def print_profile(case: str, prof: dict) -> None:
    print(
        f"\n[profile] ours, {case}: {prof['total_s']:.2f}s under cProfile (not in the table; it inflates Python code)"
    )
    for step in prof["steps"]:
        print(f"  {step['step']:<44}{step['cumulative_s']:>8.2f}s {step['fraction']:>6.1%}")
    print(f"  top by own time:\n{prof['top_tottime']}")


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__, "1 MB of text, 0.5 MB of chat, one repeat, no profile")
    ap.add_argument("--size-mb", type=float, help="text corpus size in MB of text (default 20)")
    ap.add_argument("--chat-size-mb", type=float, help="chat JSONL size in MB, the pairs' as many repeats (default 5)")
    ap.add_argument("--repeats", type=int, help="measurements of each side per case (default 3)")
    ap.add_argument("--threads", type=int, default=len(_allowed_cores()), help="threads = cores (default: all)")
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--num-proc", type=int, default=None, help="tokenize_data's num_proc (default None, as the flow)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of text,chat,preference")
    ap.add_argument("--profile", choices=["auto", "always", "never"], help="auto (the default): cases that fail")
    ap.add_argument("--workdir", type=Path, default=None, help="where the inputs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the inputs")
    ap.add_argument("--results", type=Path, default=RESULTS / "tokenization.json")
    args = ap.parse_args()
    args.size_mb = pick(args.size_mb, args.quick, 1.0, 20.0)
    args.chat_size_mb = pick(args.chat_size_mb, args.quick, 0.5, 5.0)
    args.repeats = pick(args.repeats, args.quick, 1, 3)
    args.profile = pick(args.profile, args.quick, "never", "auto")
    return args


def _allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def run(args: argparse.Namespace, work: Path) -> dict:
    cases = [c for c in args.cases.split(",") if c]
    cores = _allowed_cores()[: args.threads]
    t0 = time.perf_counter()
    inputs = build_inputs(work, args.size_mb, args.chat_size_mb)
    log(
        f"built inputs in {time.perf_counter() - t0:.0f}s: text {inputs['text_mb']:.1f} MB, "
        f"chat {inputs['chat']['file_mb']:.1f} MB"
    )
    host = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cores_used": len(cores),
        "cores_pinned": cores,
        "threads": args.threads,
        "loadavg_before": loadavg(),
    }
    runner = Runner(work, inputs, args, cores)
    runs = []
    for rep in range(args.repeats):
        for case in cases:
            order = ("baseline", "ours") if rep % 2 == 0 else ("ours", "baseline")
            runs.extend(runner.measure(kind, case) for kind in order)
    host["loadavg_after"] = loadavg()
    summary = {c: summarise(c, runs, inputs[c]["documents"]) for c in cases}
    report = {"host": host, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    report.update(inputs=inputs, runs=runs, summary=summary, profiles={})
    print_report(report)
    for case in cases:
        if args.profile == "always" or (args.profile == "auto" and not summary[case]["met"]):
            report["profiles"][case] = runner.measure("ours", case, profile=True)["profile"]
            print_profile(case, report["profiles"][case])
    return report


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    args = parse_args()
    work = work_dir(args.workdir, "tokenization-bench-")
    started = time.perf_counter()
    try:
        report = run(args, work)
        report["total_s"] = time.perf_counter() - started
        print(f"\n[bench] {report['total_s']:.0f}s in all")
        write_results(args.results, report)
    finally:
        if args.keep:
            print(f"[bench] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
