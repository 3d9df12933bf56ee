"""benchmarks/serve_compare.py's bench client: `vllm bench serve`'s command line and
environment, the result file it writes, the client that runs it per grid point (a fresh
command, or one shared process), and the word tokenizer the emulated engines' bench uses
(a module the script imports, not a script)."""

from __future__ import annotations

import itertools
import json
import os
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_compare_plan import BENCH_CLIENTS, Point

# the script: its hidden --bench-runner option is the shared bench process
ENTRY = Path(__file__).with_name("serve_compare.py")


# -- one bench run ----------------------------------------------------------------------

@dataclass
class BenchResult:
    """What `vllm bench serve --save-result` wrote (its own key names in the comments)."""

    completed: int  # completed
    failed: int  # failed
    duration_s: float  # duration: first request sent .. last answer
    ttft_mean_ms: float | None  # mean_ttft_ms
    ttft_median_ms: float | None  # median_ttft_ms
    ttft_p99_ms: float | None  # p99_ttft_ms
    tpot_mean_ms: float | None  # mean_tpot_ms
    req_s: float | None  # request_throughput
    errors: list[str] = field(default_factory=list)  # errors (with --save-detailed): the distinct ones


def parse_bench_result(path: str | Path) -> BenchResult:
    """A ValueError naming the problem for a result that is not what the bench writes.
    With no completed request the bench still writes 0 for every latency: those are None here,
    so a failed round never enters a median as 0 ms."""
    try:
        r = json.loads(Path(path).read_text())
        errors = sorted({str(e).strip().splitlines()[-1][:300] for e in r.get("errors") or [] if e and str(e).strip()})
        completed = int(r["completed"])
        lat = {k: (r.get(k) if completed else None) for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                                               "mean_tpot_ms", "request_throughput")}
        return BenchResult(completed=completed, failed=int(r.get("failed") or 0), duration_s=float(r["duration"]),
                           ttft_mean_ms=lat["mean_ttft_ms"], ttft_median_ms=lat["median_ttft_ms"],
                           ttft_p99_ms=lat["p99_ttft_ms"], tpot_mean_ms=lat["mean_tpot_ms"],
                           req_s=lat["request_throughput"], errors=errors)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path}: not a vllm bench serve result ({type(e).__name__}: {e})") from None


def bench_argv(base_url: str, model: str, tokenizer: str | Path, point: Point, prompts: int, seed: int,
               result_dir: str | Path, result_name: str) -> list[str]:
    from kvpath.testbed.vllm_server import vllm_executable

    return [vllm_executable(), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(point.input_len),
            "--random-output-len", str(point.output_len), "--ignore-eos", "--request-rate", f"{point.rate:g}",
            "--num-prompts", str(prompts), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", result_name]


def bench_env() -> dict[str, str]:
    """Offline (the tokenizer is a local folder), and no HTTP proxy between the bench and ours."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class BenchClient:
    """Runs `vllm bench serve` for a grid point, with the command's own arguments.

    ``cli``: the `vllm bench serve` command, a fresh process per point. ``shared``: one
    process, started before any engine, imports `vllm bench serve`'s module
    (``vllm.benchmarks.serve``) once and runs each point's arguments through the command's
    own parser and entry point; each run writes the same result file. The measured
    window is the same code either way; ``shared`` only saves the import, which with the
    in-tree connectors' spinning progress threads takes over a minute per point here."""

    def __init__(self, kind: str, log: Path) -> None:
        if kind not in BENCH_CLIENTS:
            raise ValueError(f"bench client must be one of {BENCH_CLIENTS}, got {kind!r}")
        self.kind, self.log = kind, log
        self._proc: subprocess.Popen | None = None
        self._answers: Any = None

    def start(self, timeout_s: float = 300.0) -> None:
        if self.kind != "shared" or (self._proc is not None and self._proc.poll() is None):
            return
        r, w = os.pipe()
        with open(self.log, "a") as log:
            self._proc = subprocess.Popen([sys.executable, str(ENTRY), "--bench-runner", str(w)],
                                          stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          env=bench_env(), pass_fds=(w,), start_new_session=True, text=True)
        os.close(w)
        self._answers = os.fdopen(r)
        if self._answer(timeout_s) != {"ready": True}:
            self.close()
            raise RuntimeError(f"the shared vllm bench serve process did not start: see {self.log}")

    def _answer(self, timeout_s: float) -> dict[str, Any] | None:
        import select

        if not select.select([self._answers], [], [], timeout_s)[0]:
            return None
        line = self._answers.readline()
        return json.loads(line) if line else None

    def run(self, argv: list[str], log: Path, timeout_s: float) -> int | None:
        """The bench's exit status (None: it did not finish in ``timeout_s`` and was killed, or
        the shared process died; the next run starts a fresh one)."""
        if self.kind == "cli":
            with open(log, "w") as f:
                try:
                    return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=bench_env(),
                                          timeout=timeout_s).returncode
                except subprocess.TimeoutExpired:
                    return None
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"argv": argv[3:], "log": str(log)}) + "\n")  # after "vllm bench serve"
        self._proc.stdin.flush()
        got = self._answer(timeout_s)
        if got is None or "rc" not in got:
            self.close()  # the next point starts a fresh one
            return None
        return int(got["rc"])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 9)
            except ProcessLookupError:
                pass
            self._proc.wait(10)
        if self._answers is not None:
            self._answers.close()
        self._proc = self._answers = None


def bench_runner(answer_fd: int) -> int:
    """The shared bench process (``--bench-runner FD``): one JSON line per run on stdin,
    ``{"argv": [...], "log": PATH}``, its output into PATH, ``{"rc": N}`` on FD."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    answers = os.fdopen(answer_fd, "w")
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(req["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                parser = FlexibleArgumentParser(prog="vllm bench serve")
                add_cli_args(parser)
                BenchmarkServingSubcommand.cmd(parser.parse_args(req["argv"]))
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - the run failed; its traceback goes to its log
                import traceback

                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()
    return 0


def build_word_tokenizer(out: Path, words: int = 4096) -> Path:
    """A tokenizer whose tokens are whitespace-separated 3-letter words, for the emulated
    engines: they count a text prompt's tokens as its words, so `vllm bench serve`'s input
    lengths are theirs exactly, and at 4 characters a token the proxy's flow-size estimate
    (characters / 4) is exact too."""
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for w in itertools.islice(itertools.product(string.ascii_lowercase, repeat=3), words - 1):
        vocab["".join(w)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(out))
    return out
