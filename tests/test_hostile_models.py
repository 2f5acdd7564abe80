"""A model folder or GGUF file is someone else's code and sizes: its chat template, its tokenizer,
its config and its generation defaults each get a bound, and a server a run depends on (the
Hugging Face Hub, W&B) that keeps silent is refused before anything is written."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Regex, normalizers, pre_tokenizers

from tclightning import network
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.models.char_tokenizer import build_char_tokenizer
from tclightning.models.config import ModelConfig, TinyModelConfig
from tclightning.models.loading import MAX_LAYERS, check_hub_model, check_model_folder, load_model
from tclightning.recipes.loader import load_recipe, to_dataclass
from tclightning.run import require_logger_servers
from tclightning.sampling import PromptFormatter, SamplerConfig, build_sampler
from tclightning.tasks.config import TaskConfig
from tclightning.tasks.data import DataSource
from tests.conftest import FAST, with_pickle

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]
TINY = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
LOOPS = "{%- for a in range(100000) %}{%- for b in range(100000) %}{%- endfor %}{%- endfor %}{{ messages[0]['content'] }}"


def _model_folder(folder: Path, chat_template: str | None = None) -> Path:
    model, tokenizer = load_model(ModelConfig(source="tiny", tiny=TINY))
    tokenizer.chat_template = chat_template
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- sizes


def _config_beside_small_weights(folder: Path, config: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"norm.weight": torch.ones(8)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


LLAMA = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 64}


@pytest.mark.parametrize("config, said", [
    ({**LLAMA, "num_hidden_layers": 100_000, "hidden_size": 8}, f"not a layer count in [1, {MAX_LAYERS}]"),
    ({**LLAMA, "head_dim": 2**24}, "far more than its weight files hold"),  # a size key of its own
    ({"model_type": "gpt2", "n_embd": 4096, "n_layer": 1000, "n_head": 32, "vocab_size": 64}, "far more than"),
], ids=["thin-layers", "head-dim", "gpt2-keys"])
def test_a_config_describing_more_than_its_weights_is_refused_before_anything_is_allocated(
        tmp_path: Path, config: dict, said: str) -> None:
    folder = _config_beside_small_weights(tmp_path / "model", config)
    with pytest.raises(TclightningError, match="nothing was allocated") as refused:
        check_model_folder(folder)
    assert said in str(refused.value)


def test_a_custom_code_model_the_recipe_trusts_gets_the_size_bound_without_a_question(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta model was built without ``trust_remote_code``: transformers refused (or asked on a
    terminal, waiting 15 s), and the bound was skipped: a 1000-layer config beside 2-layer weights trained."""
    folder = _config_beside_small_weights(tmp_path / "model", {
        **LLAMA, "model_type": "mycustom", "num_hidden_layers": 1000, "intermediate_size": 4096,
        "auto_map": {"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"}})
    (folder / "custom.py").write_text("from transformers import LlamaConfig, LlamaForCausalLM\n"
                                      "class MyConfig(LlamaConfig):\n    model_type = 'mycustom'\n"
                                      "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
    monkeypatch.setattr("builtins.input", lambda *args: pytest.fail("transformers asked a question"))
    with pytest.raises(TclightningError, match="far more than its weight files hold"):
        check_model_folder(folder, trust_remote_code=True)


def _gguf(path: Path, blocks: int = 1, width: int = 16, chat_template: str | None = None) -> Path:
    """A valid llama GGUF whose metadata says ``blocks`` layers of ``width``; its tensors are one
    16-wide layer's."""
    import gguf

    tokens = ["<pad>", "<s>", "</s>", "<unk>", *"0123456789+-=abcdefghijklmnopqrstuvwxyz"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(width)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(tokens) - 4))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", len(tokens), 16)
    writer.add_tensor("output_norm.weight", np.ones(16, np.float32))
    tensor("output.weight", len(tokens), 16)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(16, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(16, np.float32))
    for name, shape in (("attn_q", (16, 16)), ("attn_k", (8, 16)), ("attn_v", (8, 16)), ("attn_output", (16, 16)),
                        ("ffn_gate", (32, 16)), ("ffn_up", (32, 16)), ("ffn_down", (16, 32))):
        tensor(f"blk.0.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_bounded_by_its_size_as_a_model_folder_is(tmp_path: Path) -> None:
    model, _ = load_model(ModelConfig(source="gguf", gguf_file=str(_gguf(tmp_path / "ok.gguf"))))
    assert model.config.num_hidden_layers == 1  # the control: the same file with honest metadata loads
    for name, blocks, width, said in (("blocks", 100_000, 16, "not a layer count"), ("wide", 4, 100_000, "far more")):
        with pytest.raises(TclightningError, match="nothing was allocated") as refused:
            load_model(ModelConfig(source="gguf", gguf_file=str(_gguf(tmp_path / f"{name}.gguf", blocks, width))))
        assert said in str(refused.value) and f"{name}.gguf" in str(refused.value)


def test_reading_a_gguf_file_s_metadata_has_a_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse file can claim an array of 10^9 empty strings in its metadata, and the reader builds
    an object for each: a limit no reading meets stands in for one that takes minutes."""
    from tclightning.models import loading

    monkeypatch.setattr(loading, "GGUF_METADATA_TIME_S", 0.0)
    with pytest.raises(TclightningError, match="ok.gguf: reading its metadata took more than 0 s"):
        load_model(ModelConfig(source="gguf", gguf_file=str(_gguf(tmp_path / "ok.gguf"))))


# --------------------------------------------------------------------------- chat templates, tokenizers


@pytest.mark.parametrize("template, said", [
    (LOOPS, "its chat template took more than"),
    ("{{ raise_exception('boom') }}", "its chat template fails on a prompt (TemplateError: boom)"),
    ("{{ messages[0]['content'] }}{{ 'a' * 100000 }}", "its chat template adds more than 65536 characters"),
], ids=["loops", "raises", "grows"])
def test_a_chat_template_that_loops_raises_or_grows_is_one_error_naming_the_tokenizer(template: str, said: str) -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    formatter = PromptFormatter(tokenizer, "be brief", True)
    for call in (lambda: formatter.lengths(["1+1=", "2+2="]), lambda: formatter.encode(["1+1="]),
                 lambda: formatter.render("1+1=")):
        with pytest.raises(TclightningError, match="^the tokenizer of ") as refused:
            call()
        assert said in str(refused.value)


def _raised_in_a_thread(call: Callable[[], object]) -> BaseException | None:
    """What ``call()`` raises in a thread of its own (as a program of yours calls tclightning from
    one), waited for at most 30 s; None if it returned (or is still running)."""
    import threading

    outcome: list[BaseException | None] = []

    def called() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            outcome.append(err)

    caller = threading.Thread(target=called)
    caller.start()
    caller.join(30)
    return outcome[0] if outcome else None


def test_a_chat_template_that_loops_is_bounded_in_a_thread_of_your_program_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``run(...)`` called from a thread of a program rendered a looping chat template for ever: the
    limit was an alarm, which only the main thread gets."""
    import tclightning.limits as limits
    import tclightning.sampling.base as sampling_base

    monkeypatch.setattr(limits, "_ABANDONED", [])  # this process's work given up on: none yet
    monkeypatch.setattr(sampling_base, "TEMPLATE_TIME_S", 0.2)
    tokenizer = build_char_tokenizer()  # loops for seconds (not for ever: the test's process goes on)
    tokenizer.chat_template = ("{%- for a in range(3000) %}{%- for b in range(3000) %}{%- endfor %}{%- endfor %}"
                               "{{ messages[0]['content'] }}")
    formatter = PromptFormatter(tokenizer, "be brief", True)
    raised = _raised_in_a_thread(lambda: formatter.render("1+1="))
    assert isinstance(raised, TclightningError) and "its chat template took more than" in str(raised), raised


def test_a_run_on_a_model_whose_chat_template_loops_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _model_folder(tmp_path / "model", LOOPS)
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *FAST, "trainer.steps=1", "model.source=hf", f"model.name={folder}",
                 f"logging.root={tmp_path / 'runs'}", "--quiet"]) == 2
    said = capsys.readouterr().err
    err = [line for line in said.splitlines() if line.startswith("error:")]
    assert "Traceback" not in said and len(err) == 1, said
    assert err[0].startswith(f"error: the tokenizer of {folder}: its chat template took"), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))


def test_a_tokenizer_that_panics_on_a_prompt_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as the CLI sets it: a panic in the pool deadlocks it
    tokenizer = build_char_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Prepend("a" * 44)  # (a|aa)+$ on 44 a's: past Oniguruma's retry limit
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("(a|aa)+$"), "isolated"),
                                                     pre_tokenizers.Split(Regex("."), "isolated")])
    with pytest.raises(TclightningError, match="tokenizers panicked"):
        PromptFormatter(tokenizer, None, False).lengths(["1+1="])


def test_the_tokenizer_gets_one_time_budget_for_the_prompts_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.sampling import base

    formatter = PromptFormatter(build_char_tokenizer(), None, False)
    prompts = [f"{i}+{i}=" for i in range(200)]
    assert formatter.lengths(prompts) == [len(p) for p in prompts]  # a token a character
    monkeypatch.setattr(base, "TOKENIZE_TIME_S", 0.0)  # a budget no tokenizer meets: a quadratic regex's
    monkeypatch.setattr(base, "TOKENIZE_TIME_PER_CHAR_S", 0.0)
    with pytest.raises(TclightningError, match="^the tokenizer of .*: it took more than 0 s to tokenize 200 prompt"):
        formatter.lengths(prompts)


@pytest.mark.parametrize("where", [0, 150], ids=["first-prompt", "past-the-first-64"])
def test_a_tokenizer_that_multiplies_the_text_is_refused_from_a_separate_process(
        monkeypatch: pytest.MonkeyPatch, where: int) -> None:
    """Seven chained normalizers each turning "#" into forty: 40^7 characters for the prompt that
    holds one, wherever it is among the prompts. In the run's own process that is a crash (or the
    OOM killer); measured in a separate process with a memory limit, it is one refusal."""
    from tclightning.sampling import base

    monkeypatch.setattr(base, "TOKENIZE_MEMORY_BYTES", 2**30)
    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Replace("#", "#" * 40)] * 7)
    prompts = [f"{i}+{i}=" for i in range(200)]
    assert PromptFormatter(tokenizer, None, False).lengths(prompts) == [len(p) for p in prompts]  # the control
    prompts[where] = "#+1="
    # which limit stops it first depends on the machine's load: either is the refusal
    with pytest.raises(TclightningError, match="tokenizing the prompts ran out of 1 GiB of memory|it took more than"):
        PromptFormatter(tokenizer, None, False).lengths(prompts)


def test_a_python_tokenizer_is_measured_under_the_same_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.sampling import base

    class Slow:  # no backend_tokenizer: measured in this process, where a signal reaches it
        chat_template = None
        name_or_path = "slow"

        def __call__(self, texts: list[str], **kwargs: object) -> dict:
            import time
            time.sleep(5)
            return {"input_ids": [[0] * len(t) for t in texts]}

    monkeypatch.setattr(base, "TOKENIZE_TIME_S", 0.2)
    with pytest.raises(TclightningError, match="^the tokenizer of slow: it took more than 0.2"):
        PromptFormatter(Slow(), None, False).lengths(["1+1="])  # type: ignore[arg-type]


def test_the_cli_runs_tokenizers_on_one_thread() -> None:
    code = ("import os, sys; os.environ['TOKENIZERS_PARALLELISM'] = 'true'; sys.argv = ['tclightning', 'recipes', "
            "'list']\nfrom tclightning.cli.main import main\nmain(); print(os.environ['TOKENIZERS_PARALLELISM'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip().splitlines()[-1] == "false", done.stderr[-2000:]


def test_a_model_folder_s_sampling_defaults_do_not_reach_the_sampler(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": True, "num_return_sequences": 3,
         "repetition_penalty": 3.0, "min_new_tokens": 5}))
    model, tokenizer = load_model(ModelConfig(source="hf", name=str(folder)))
    given = model.generation_config
    assert {given.num_return_sequences, given.repetition_penalty, given.min_new_tokens, given.do_sample} == {None}
    assert (given.eos_token_id, given.pad_token_id) == (2, tokenizer.pad_token_id)
    sampler = build_sampler(SamplerConfig(max_new_tokens=4), PromptFormatter(tokenizer, None, False))
    rollouts = sampler.generate(model, ["1+1=", "2+2="], group_size=2, seed=0)
    assert rollouts.num_sequences == 4  # not 12


# --------------------------------------------------------------------------- servers that keep silent


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A host that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture
def closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


class _HeadOnly(_NotFound):
    """Answers HEAD at once and keeps every GET waiting (as long as the test runs)."""

    def do_GET(self) -> None:  # noqa: N802
        threading.Event().wait(30)


class _AnswersOnce(_NotFound):
    """Answers the first request at once and keeps every later one waiting (as long as the test runs):
    a server that passes a check asked before the work, then stalls."""

    answered = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802
        if self.answered.acquire(blocking=False):
            super().do_GET()
        else:
            threading.Event().wait(30)

    do_HEAD = do_GET


class _DripsAHeader(_NotFound):
    """Sends a status line, then one byte of an endless header every 0.1 s (for 20 s): each read
    is answered well within any per-read limit."""

    def do_GET(self) -> None:  # noqa: N802
        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
        deadline = time.monotonic() + 20
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                self.wfile.write(b"a")
                self.wfile.flush()
                time.sleep(0.1)


@pytest.fixture
def dripping_server() -> Iterator[str]:
    yield from _serve(_DripsAHeader)


@pytest.fixture
def once_server() -> Iterator[str]:
    class Handler(_AnswersOnce):
        answered = threading.Lock()

    yield from _serve(Handler)


@pytest.fixture
def answering_server() -> Iterator[str]:
    yield from _serve(_NotFound)


@pytest.fixture
def head_only_server() -> Iterator[str]:
    yield from _serve(_HeadOnly)


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE",
                 "HF_DATASETS_OFFLINE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(network, "ANSWER_TIMEOUT_S", 0.5)


def test_no_answer_tells_a_silent_host_from_a_closed_port_and_an_answer(
        silent_server: str, closed_port: str, answering_server: str) -> None:
    assert network.no_answer(silent_server).timed_out
    refused = network.no_answer(closed_port)
    assert refused is not None and not refused.timed_out
    assert network.no_answer(answering_server) is None  # a 404 is an answer


@pytest.mark.timeout(60)
def test_no_answer_limits_the_whole_answer_not_each_read(dripping_server: str) -> None:
    """A server dripping an endless header a byte at a time answers every read in time: the check
    asked before a run waited for ever."""
    started = time.monotonic()
    verdict = network.no_answer(dripping_server)
    assert verdict is not None and verdict.timed_out
    assert time.monotonic() - started < 5  # the limit is 0.5 s; the server drips for 20


@pytest.mark.parametrize("answer", ["etag-absolute", "etag-up-and-out", "commit-of-a-missing-file", "info-sha"])
def test_a_hub_answer_that_names_a_path_writes_nothing_there(answer: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub names a download ``blobs/<ETag>``, a missing file's mark
    ``.no_exist/<commit>/<name>`` and the revision asked for (a repository info's ``sha``)
    ``refs/<revision>``, unchecked: a hub answering an ETag or a commit that is a path had a file
    written there (a ``.pth`` in your site folder ran at every later ``python``; a file of yours
    overwritten with the commit)."""
    import hashlib

    from huggingface_hub.utils._http import close_session

    from tclightning.models.loading import download_hub_model

    planted = tmp_path / "site-packages" / "zz_hub.pth"
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"import os\n"}
    missing = "tokenizer.json"  # listed, then answered 404 with the commit a path
    commit = hashlib.sha1(b"commit").hexdigest()
    named = {"etag-absolute": str(planted), "etag-up-and-out": "../../../../site-packages/zz_hub.pth"}.get(answer)
    sha = f"../../../../../../../../../../..{planted}" if answer == "info-sha" else commit

    class Hub(_NotFound):
        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path.startswith("/api/models/"):
                listed = [{"rfilename": n, "size": len(b)} for n, b in files.items()]
                listed += [{"rfilename": missing, "size": 10}] if answer == "commit-of-a-missing-file" else []
                body = json.dumps({"id": "someone/tiny", "sha": sha, "siblings": listed}).encode()
                headers = {"Content-Type": "text/plain"}  # huggingface_hub parses it as JSON all the same
            elif "/resolve/" in path and (name := path.split("/resolve/", 1)[1].split("/", 1)[1]) in files:
                body = files[name]
                tag = named if name == "model.safetensors" and named else hashlib.sha1(body).hexdigest()
                headers = {"X-Repo-Commit": commit, "ETag": f'"{tag}"'}
            elif path.endswith(f"/{missing}"):
                self.send_response(404)
                for key, value in {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": str(planted.parent),
                                   "Content-Length": "0"}.items():
                    self.send_header(key, value)
                self.end_headers()
                return None
            else:
                return super().do_GET()
            self.send_response(200)
            for key, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_HEAD = do_GET

    hub = _serve(Hub)
    monkeypatch.setenv("HF_ENDPOINT", next(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", os.environ["HF_ENDPOINT"])  # read at its import
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        os.environ["HF_ENDPOINT"] + "/{repo_id}/resolve/{revision}/{filename}")
    close_session()  # a session of an earlier test's factory
    try:
        with pytest.raises(TclightningError, match="answered a file's (ETag|commit) .* which is no hash but names a "
                                                   "path"):
            download_hub_model("someone/tiny")
    finally:
        next(hub, None)
    assert not list(tmp_path.rglob("zz_hub.pth*")) and not (planted.parent / missing).exists()


@pytest.mark.parametrize("sent", ["plain", "byte-order-mark", "utf-16", "chunked"])
def test_a_dataset_info_s_sha_naming_a_path_is_refused_however_the_answer_is_sent(
        sent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset's info whose ``sha`` is a path (``datasets`` takes it for the revision and its cache
    folder) passed the check when the answer began with a byte-order mark, was UTF-16 or came
    chunked, with no size: huggingface_hub reads each all the same."""
    from huggingface_hub.utils._http import close_session

    from tclightning.tasks.data import DataSource

    sha = "x/../../../../../../../.." + str(tmp_path / "victim")
    info = json.dumps({"id": "someone/ds", "sha": sha, "siblings": [{"rfilename": "train.jsonl", "size": 9}]})
    body = {"plain": info.encode(), "byte-order-mark": b"\xef\xbb\xbf" + info.encode(),
            "utf-16": info.encode("utf-16"), "chunked": info.encode()}[sent]

    class Hub(_NotFound):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            if path != "/api/datasets/someone/ds" and not path.startswith("/api/datasets/someone/ds/revision/"):
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if sent == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            else:
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        do_HEAD = do_GET

    hub = _serve(Hub)
    monkeypatch.setenv("HF_ENDPOINT", next(hub))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for read_at_import in ("huggingface_hub.constants.ENDPOINT", "datasets.config.HF_ENDPOINT"):
        monkeypatch.setattr(read_at_import, os.environ["HF_ENDPOINT"])
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        os.environ["HF_ENDPOINT"] + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr("datasets.config.HUB_DATASETS_URL",
                        os.environ["HF_ENDPOINT"] + "/datasets/{repo_id}/resolve/{revision}/{path}")
    close_session()  # a session of an earlier test's factory
    try:
        with pytest.raises(TclightningError, match="answered a file's commit .* which is no hash but names a path"):
            DataSource.from_config(TaskConfig(name="gsm8k", hf_name="someone/ds"), "gsm8k").splits()
    finally:
        next(hub, None)
    assert not (tmp_path / "victim").exists()


@pytest.mark.parametrize("how", ["silent", "answers-head-only", "through-a-silent-all-proxy"])
def test_a_silent_hub_is_refused_for_a_model_and_a_dataset(how: str, silent_server: str, head_only_server: str,
                                                            answering_server: str, request: pytest.FixtureRequest,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "through-a-silent-all-proxy":  # the hub answers, but its library's requests go through the proxy
        from huggingface_hub.utils._http import close_session

        monkeypatch.setenv("HF_ENDPOINT", answering_server)
        monkeypatch.setenv("ALL_PROXY", silent_server)
        close_session()  # huggingface_hub's session reads the proxies once, when it is made
        request.addfinalizer(close_session)
    else:
        monkeypatch.setenv("HF_ENDPOINT", silent_server if how == "silent" else head_only_server)
    with pytest.raises(TclightningError, match="not in the Hugging Face cache and 127.0.0.1 does not answer"):
        check_hub_model(ModelConfig(source="hf", name="nobody/not-cached-anywhere"))
    with pytest.raises(TclightningError, match="task.hf_name openai/gsm8k: the Hugging Face Hub .* gives no answer"):
        DataSource.from_config(TaskConfig(name="gsm8k", hf_name="openai/gsm8k"), "gsm8k")


@pytest.mark.timeout(60)  # a regression waits on the hub: fail instead
@pytest.mark.parametrize("drip", ["keeps-the-pace", "drips", "expands-without-end", "fails", "interrupted"])
def test_a_hub_dataset_download_must_keep_up_a_rate_and_ends_with_its_process(
        drip: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub dripping a dataset's data file held `tclightning run` for ever: its download must keep
    the rate a model's does, counted on the bytes its folders gain, goes over HTTP, and stops past a
    task's largest data (a compressed stream expands without end at disk speed). It runs in a
    process of its own, ended then (or on a Ctrl-C): datasets' download threads, given up on, held
    the exit of a Python program that had called tclightning for ever."""
    from types import SimpleNamespace

    import huggingface_hub

    import tclightning.limits as limits
    import tclightning.network as network
    import tclightning.tasks.data as data_module
    from tclightning.tasks.data import _paced_download

    monkeypatch.setattr(limits, "_ABANDONED", [])  # this process's work given up on: none yet
    monkeypatch.setattr(network, "REMOTE_SETUP_S", 0.2)
    monkeypatch.setattr(data_module, "TASK_FILE_MAX_BYTES", 4 * 2**20)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    downloads = tmp_path / "datasets" / "downloads"
    downloads.mkdir(parents=True)
    prepared = tmp_path / "datasets" / "someone___rows" / "default" / "0.0.0"
    pid_file = tmp_path / "download.pid"
    size = {"drips": 10, "expands-without-end": 5 * 2**20}.get(drip, 3 * 2**20)
    # the download's process, as datasets' would behave against such a hub
    monkeypatch.setattr(data_module, "_HUB_DOWNLOAD", f"""
import os, pathlib, sys, time
assert os.environ["HF_HUB_DISABLE_XET"] == "1"  # over HTTP, where the pace holds
pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
pathlib.Path({str(downloads / "data.parquet.incomplete")!r}).write_bytes(b"x" * {size})
if {drip!r} == "fails":
    sys.stderr.write("downloading...\\nConnectionError: the hub hung up\\n")
    sys.exit(1)
if {drip!r} == "keeps-the-pace":
    pathlib.Path({str(prepared)!r}).mkdir(parents=True)
    pathlib.Path({str(prepared / "dataset_info.json")!r}).write_text("{{}}")
    sys.exit(0)
time.sleep(120)  # a byte every few seconds, for ever
""")
    if drip == "interrupted":
        def interrupted(received: int, started: float) -> bool:
            raise KeyboardInterrupt
        monkeypatch.setattr(data_module, "keeps_pace", interrupted)
    builder = SimpleNamespace(_cache_downloaded_dir=str(downloads), cache_dir=str(prepared))
    said = {"drips": "its download fell below 1 MiB/s", "fails": "ConnectionError: the hub hung up",
            "expands-without-end": "its download and preparation passed 5242880 bytes, more than a task's data may be"}
    if drip == "keeps-the-pace":
        _paced_download(builder, "someone/rows", None, None)
    elif drip == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            _paced_download(builder, "someone/rows", None, None)
    else:
        with pytest.raises(TclightningError, match=f"someone/rows.*: .*{said[drip]}"):
            _paced_download(builder, "someone/rows", None, None)
    with pytest.raises(ProcessLookupError):  # ended, and nothing of it left for this process's exit
        os.kill(int(pid_file.read_text()), 0)
    assert not limits.abandoned_work()


def test_a_hub_that_cannot_be_reached_at_all_leaves_a_dataset_to_the_datasets_cache(closed_port: str,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", closed_port)
    assert DataSource.from_config(TaskConfig(name="gsm8k", hf_name="openai/gsm8k"), "gsm8k").hf_name == "openai/gsm8k"


@pytest.mark.parametrize("server", ["silent_server", "closed_port"])
def test_a_wandb_logger_whose_server_does_not_answer_is_refused(server: str, request: pytest.FixtureRequest,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_BASE_URL", request.getfixturevalue(server))
    recipe = to_dataclass(load_recipe("tiny"))
    recipe.logging.loggers = ["wandb"]
    with pytest.raises(TclightningError, match="the W&B server 127.0.0.1 does not answer"):
        require_logger_servers(recipe)
    monkeypatch.setenv("WANDB_MODE", "offline")  # logs locally: no server asked
    require_logger_servers(recipe)


def test_a_wandb_logger_s_own_server_setting_is_the_one_asked(silent_server: str, answering_server: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_args.settings.base_url`` is the server wandb.init talks to, whatever the environment
    says: a silent one there was waited on for two minutes, then a traceback."""
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", answering_server)
    recipe = to_dataclass(load_recipe("tiny"))
    recipe.logging.loggers = ["wandb"]
    require_logger_servers(recipe)  # the environment's server answers
    recipe.logging.loggers = [{"class_path": "wandb", "init_args": {"settings": {"base_url": silent_server}}}]
    with pytest.raises(TclightningError, match="the W&B server 127.0.0.1 does not answer"):
        require_logger_servers(recipe)


def test_a_malformed_server_url_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://[::1")
    recipe = to_dataclass(load_recipe("tiny"))
    recipe.logging.loggers = ["mlflow"]
    with pytest.raises(TclightningError, match=r"the MLflow server http://\[::1 does not answer"):
        require_logger_servers(recipe)


@pytest.mark.parametrize("server", ["silent_server", "closed_port"])
@pytest.mark.parametrize("class_path", ["mlflow", "lightning.pytorch.loggers.mlflow.MLFlowLogger"])
def test_an_mlflow_logger_whose_server_does_not_answer_is_refused(server: str, class_path: str,
                                                                  request: pytest.FixtureRequest,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One that accepts and never answers was waited on without end (a closed one, retried for
    minutes); the class decides, whichever path names it (its module's path was not asked)."""
    recipe = to_dataclass(load_recipe("tiny"))
    recipe.logging.loggers = [{"class_path": class_path, "init_args": {"tracking_uri": request.getfixturevalue(server)}}]
    with pytest.raises(TclightningError, match="the MLflow server 127.0.0.1 does not answer"):
        require_logger_servers(recipe)
    recipe.logging.loggers = ["mlflow"]  # a local file store: no server asked
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    require_logger_servers(recipe)


def test_an_mlflow_logger_logging_to_its_server_in_the_background_is_refused(
        answering_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's asynchronous logging runs in its own threads, which no time limit reaches: a server
    that drips its answers held the command's exit for ever (``tclightning run`` and ``lightning fit``)."""
    from lightning.pytorch.loggers import MLFlowLogger

    from tclightning.logging import ask_remote_stores

    monkeypatch.delenv("MLFLOW_ENABLE_ASYNC_LOGGING", raising=False)
    recipe = to_dataclass(load_recipe("tiny"))
    logger = {"class_path": "mlflow", "init_args": {"tracking_uri": answering_server, "synchronous": False}}
    recipe.logging.loggers = [logger]
    with pytest.raises(TclightningError, match=r"logging.loggers\[0\]: the MLflow logger logs to its server from "
                                               "MLflow's background threads"):
        require_logger_servers(recipe)
    fit = SimpleNamespace(loggers=[MLFlowLogger(tracking_uri=answering_server, synchronous=False)], callbacks=[],
                          default_root_dir=str(tmp_path), profiler=None)
    with pytest.raises(TclightningError, match="the MLFlowLogger logs to its server from MLflow's background"):
        ask_remote_stores(fit)
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "true")  # unset synchronous: the environment decides
    recipe.logging.loggers = [{"class_path": "mlflow", "init_args": {"tracking_uri": answering_server}}]
    with pytest.raises(TclightningError, match="background threads"):
        require_logger_servers(recipe)
    monkeypatch.delenv("MLFLOW_ENABLE_ASYNC_LOGGING")
    for synchronous, uri in ((0, answering_server), ("", answering_server), (False, answering_server.upper()),
                             (False, f" {answering_server}"), (False, "databricks")):
        recipe.logging.loggers = [{"class_path": "mlflow", "init_args": {"tracking_uri": uri,
                                                                         "synchronous": synchronous}}]
        with pytest.raises(TclightningError, match="background threads"):  # as MLflow reads them
            require_logger_servers(recipe)
    recipe.logging.loggers = [{**logger, "init_args": {**logger["init_args"], "synchronous": True}}]
    require_logger_servers(recipe)  # synchronous: each call has its limit
    recipe.logging.loggers = [{"class_path": "mlflow", "init_args": {"tracking_uri": f"file:{tmp_path}/mlruns",
                                                                     "synchronous": False}}]
    require_logger_servers(recipe)  # a local store: no server to stall


def test_weights_in_a_sub_folder_and_a_cached_hub_model_get_the_size_bound(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sharded = _config_beside_small_weights(tmp_path / "sharded", {**LLAMA, "intermediate_size": 4_000_000,
                                                                   "num_hidden_layers": 100})
    (sharded / "shards").mkdir()
    (sharded / "model.safetensors").rename(sharded / "shards" / "model.safetensors")  # named by an index
    with pytest.raises(TclightningError, match="far more than its weight files hold"):
        check_model_folder(sharded)
    snapshot = tmp_path / "hub" / "models--evil--big" / "snapshots" / "abc"
    snapshot.parent.mkdir(parents=True)
    _config_beside_small_weights(snapshot, {**LLAMA, "intermediate_size": 4_000_000, "num_hidden_layers": 100})
    (tmp_path / "hub" / "models--evil--big" / "refs").mkdir()
    (tmp_path / "hub" / "models--evil--big" / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TclightningError, match="far more than its weight files hold"):
        load_model(ModelConfig(source="hf", name="evil/big"))


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(TclightningError, match="has no end-of-sequence token"):
        load_model(ModelConfig(source="hf", name=str(folder)))


@pytest.mark.timeout(60)  # torch.load would hash a tuple 2^60 times
@pytest.mark.parametrize("weights", ["pickle-bomb", "legacy-format", "indexed-shard"])
def test_a_pickled_weights_file_is_read_as_torch_save_writes_it_before_transformers_loads_it(
        tmp_path: Path, weights: str) -> None:
    """transformers reads ``pytorch_model.bin`` with ``torch.load(weights_only=True)``, which calls
    what its pickle asks with any arguments: one that would run for hours is refused first, and a
    file in torch's legacy format (no archive to check) is named with the way out."""
    folder = _model_folder(tmp_path / "model")
    (folder / "model.safetensors").unlink()
    if weights == "pickle-bomb":
        with_pickle(folder / "pytorch_model.bin", "dict-key-of-shared-tuples")
    elif weights == "indexed-shard":  # transformers unpickles what the index names, whatever its suffix
        with_pickle(folder / "shard.dat", "dict-key-of-shared-tuples")
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "shard.dat"}}))
    else:
        torch.save({"weight": torch.zeros(1)}, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    said = "save it again with torch.save or as safetensors" if weights == "legacy-format" else "ages to hash"
    with pytest.raises(TclightningError, match=said):
        load_model(ModelConfig(source="hf", name=str(folder)))


class _Payload:
    def __reduce__(self):  # what a crafted pytorch_model.bin holds: never called here
        return (os.system, ("echo ran",))


def test_a_pickled_weights_file_that_asks_for_code_is_refused_without_torch_s_unsafe_advice(tmp_path: Path) -> None:
    """torch's refusal ends with advice to load the file with ``weights_only=False``, which is what
    must never be done with it: the line names what the file asks for instead."""
    import torch

    from tclightning.models.loading import _loader_errors

    torch.save({"weight": torch.zeros(1), "payload": _Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(TclightningError) as refused, _loader_errors(f"model folder {tmp_path}"):
        torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    line = str(refused.value)
    assert "weights_only" not in line and "could run code" in line and "system" in line, line


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"])
def test_weights_torch_saves_by_dtype_pass_the_pickle_check(tmp_path: Path, dtype: str) -> None:
    """torch.save writes float8 and the wide unsigned ints as a byte storage with a dtype
    (``_rebuild_tensor_v3``): a genuine ``pytorch_model.bin`` of them is read, and a storage of
    more bytes than its record is still refused."""
    import torch

    from tclightning.models.loading import check_model_folder
    from tclightning.tensor_files import RefusedTensorFile, check_torch_file

    folder = _model_folder(tmp_path / "model")
    (folder / "model.safetensors").unlink()
    weight = torch.arange(6).to(getattr(torch, dtype))
    torch.save({"lm_head.weight": weight}, folder / "pytorch_model.bin")
    check_model_folder(folder)
    assert torch.equal(torch.load(folder / "pytorch_model.bin", weights_only=True)["lm_head.weight"].view(torch.uint8),
                       weight.view(torch.uint8))
    nbytes = weight.nbytes
    _rewrite_pickle(folder / "pytorch_model.bin", lambda pickled: pickled.replace(
        b"K" + bytes([nbytes]) + b"t", b"K" + bytes([nbytes + 1]) + b"t", 1))
    with pytest.raises(RefusedTensorFile, match="storage of"):
        check_torch_file(folder / "pytorch_model.bin")


def _rewrite_pickle(path: Path, edit) -> None:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, edit(data) if name.endswith("data.pkl") else data)


def test_a_sharded_index_nested_past_the_json_reader_s_depth_is_one_line(tmp_path: Path) -> None:
    """An index nested deeper than Python's JSON reader recurses is the model folder's to name, not
    a RecursionError traceback from the check that looks for the shards it names."""
    folder = _model_folder(tmp_path / "model")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TclightningError, match="cannot be loaded as a model"):
        load_model(ModelConfig(source="hf", name=str(folder)))


@pytest.mark.timeout(60)  # torch.load would hash a tuple 2^60 times
def test_a_pickled_weights_file_renamed_over_the_checked_one_is_never_what_is_unpickled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder was checked by path, and transformers loaded ``pytorch_model.bin`` by path again:
    a crafted file renamed over it in between was unpickled unchecked. transformers reads the files
    as they were opened for the checks; a crafted one there is refused, naming your folder's file."""
    from safetensors.torch import load_file

    import tclightning.models.loading as loading

    folder = _model_folder(tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    model, _ = load_model(ModelConfig(source="hf", name=str(folder)))
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights.items())

    check_folder = loading.check_model_folder

    # runs between the folder's check and the load
    def swapped_after_the_check(view: Path, trust_remote_code: bool = False) -> None:
        check_folder(view, trust_remote_code)
        crafted = with_pickle(tmp_path / "crafted.bin", "dict-key-of-shared-tuples")
        os.replace(crafted, folder / "pytorch_model.bin")

    monkeypatch.setattr(loading, "check_model_folder", swapped_after_the_check)
    model, _ = load_model(ModelConfig(source="hf", name=str(folder)))  # the file checked, pinned, is the one read
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights.items())
    assert model.config._name_or_path == str(folder)
    monkeypatch.setattr(loading, "check_model_folder", check_folder)
    with pytest.raises(TclightningError, match=f"{folder}/pytorch_model.bin.*ages to hash"):  # your folder named
        load_model(ModelConfig(source="hf", name=str(folder)))


def test_a_model_config_written_over_in_place_after_its_check_is_never_what_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's config.json was checked (layers, size), then transformers read it again: one
    written over in the same file in between built a model of 40,000 layers for minutes. The
    folder's configs and tokenizer files are read from copies made when they were opened."""
    import json

    import tclightning.models.loading as loading

    folder = _model_folder(tmp_path / "model")
    honest = json.loads((folder / "config.json").read_text())
    check_folder = loading.check_model_folder

    def written_over_after_the_check(view: Path, trust_remote_code: bool = False) -> None:
        check_folder(view, trust_remote_code)
        with (folder / "config.json").open("r+") as same_file:  # the same file, not a rename
            json.dump({**honest, "num_hidden_layers": 40_000}, same_file)
            same_file.truncate()

    monkeypatch.setattr(loading, "check_model_folder", written_over_after_the_check)
    model, _ = load_model(ModelConfig(source="hf", name=str(folder)))
    assert model.config.num_hidden_layers == honest["num_hidden_layers"]


def test_a_hub_model_s_config_written_over_in_place_after_its_check_is_never_what_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A downloaded hub model's folder was checked by path, and transformers read its config.json
    again: one written over in between built 40,000 layers. It is read as a local folder is."""
    import json
    import shutil

    import tclightning.models.loading as loading

    snapshot = tmp_path / "hub" / "models--someone--small" / "snapshots" / "abc"
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(_model_folder(tmp_path / "model"), snapshot)
    (tmp_path / "hub" / "models--someone--small" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--small" / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    honest = json.loads((snapshot / "config.json").read_text())
    check_folder = loading.check_model_folder

    def written_over_after_the_check(view: Path, trust_remote_code: bool = False) -> None:
        check_folder(view, trust_remote_code)
        with (snapshot / "config.json").open("r+") as same_file:
            json.dump({**honest, "num_hidden_layers": 40_000}, same_file)
            same_file.truncate()

    monkeypatch.setattr(loading, "check_model_folder", written_over_after_the_check)
    model, _ = load_model(ModelConfig(source="hf", name="someone/small"))
    assert model.config.num_hidden_layers == honest["num_hidden_layers"]
    assert model.config._name_or_path == "someone/small"


def _cached_hub_snapshot(hub: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty snapshot folder of hub model ``name`` in a Hugging Face cache at ``hub``."""
    repo = hub / f"models--{name.replace('/', '--')}"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    return repo / "snapshots" / "abc"


def test_a_hub_model_cached_without_its_weights_is_refused_offline_before_any_file_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub model's folder whose weights never came (a download interrupted) was read by name,
    unpinned: its tokenizer files read after their check, one grown in place to gigabytes since
    was read whole. Offline it is refused; online its weights are downloaded first."""
    snapshot = _cached_hub_snapshot(tmp_path / "hub", "someone/partial", monkeypatch)
    folder = _model_folder(tmp_path / "model")
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (snapshot / name).write_bytes((folder / name).read_bytes())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TclightningError, match="'someone/partial': in the Hugging Face cache without its weights "
                                               r"\(a download that was interrupted\?\) and HF_HUB_OFFLINE is set"):
        load_model(ModelConfig(source="hf", name="someone/partial"))


def test_a_hub_model_s_missing_weights_are_downloaded_and_checked_before_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers downloaded the weights missing from a hub model's cached folder and built the
    model: the config's size check never saw them, and a config describing a billion parameters
    was allocated. The download is one set of weights and the files transformers reads; then the
    folder is checked as a local one."""
    import huggingface_hub

    import tclightning.models.loading as loading

    snapshot = _cached_hub_snapshot(tmp_path / "hub", "someone/big", monkeypatch)
    lying = _config_beside_small_weights(tmp_path / "lying", {**LLAMA, "intermediate_size": 4_000_000,
                                                              "num_hidden_layers": 100})
    (snapshot / "config.json").write_bytes((lying / "config.json").read_bytes())  # only the config was cached
    (lying / "additional_chat_templates").mkdir()
    (lying / "additional_chat_templates" / "tool.jinja").write_text("")
    repository = ["config.json", "model.safetensors", "pytorch_model.bin", "onnx/model.onnx", "onnx/config.json",
                  "README.md", "additional_chat_templates/tool.jinja", "modeling_big.py", "../outside.json",
                  "additional_chat_templates/../../outside.jinja"]
    downloaded: list[str] = []

    def download(name: str, filename: str, revision: str | None, **kwargs: object) -> str:
        assert revision == (None if filename == "model.safetensors" else "abc")  # the first's commit: all of one
        downloaded.append(filename)
        (snapshot / filename).parent.mkdir(exist_ok=True)
        (snapshot / filename).write_bytes((lying / filename).read_bytes())
        return str(snapshot / filename)

    listed = SimpleNamespace(sha="abc", siblings=[SimpleNamespace(rfilename=name, size=10) for name in repository])
    monkeypatch.setattr(loading, "hub_answer", lambda path, timeout_s=None: None)  # the hub answers
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, name, files_metadata: listed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(TclightningError, match="far more than its weight files hold"):
        load_model(ModelConfig(source="hf", name="someone/big"))
    assert downloaded == ["model.safetensors", "additional_chat_templates/tool.jinja", "config.json"]
    listed.siblings.append(SimpleNamespace(rfilename="tokenizer.json", size=2**40))  # refused once here: never fetched
    (snapshot / "model.safetensors").unlink()
    downloaded.clear()
    with pytest.raises(TclightningError, match="its tokenizer.json is 1099511627776 bytes, more than a file"):
        load_model(ModelConfig(source="hf", name="someone/big"))
    assert downloaded == []


def test_a_sharded_hub_model_downloads_the_shards_its_index_names(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is read once, from the file checked (a cache writer growing it after a check by
    name had it read whole), and only the shards it names come."""
    import huggingface_hub

    import tclightning.models.loading as loading

    snapshot = _cached_hub_snapshot(tmp_path / "hub", "someone/sharded", monkeypatch)
    folder = _model_folder(tmp_path / "model")
    (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    from safetensors import safe_open

    with safe_open(folder / "model-1.safetensors", "pt") as shard:
        weight_map = dict.fromkeys(shard.keys(), "model-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    repository = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
                  "model-1.safetensors", "model-0.safetensors", "../outside.bin"]
    downloaded: list[str] = []

    def download(name: str, filename: str, revision: str | None, **kwargs: object) -> str:
        downloaded.append(filename)
        (snapshot / filename).write_bytes((folder / filename).read_bytes())
        return str(snapshot / filename)

    listed = SimpleNamespace(sha="abc", siblings=[SimpleNamespace(rfilename=name, size=10) for name in repository])
    monkeypatch.setattr(loading, "hub_answer", lambda path, timeout_s=None: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, name, files_metadata: listed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    model, _ = load_model(ModelConfig(source="hf", name="someone/sharded"))
    assert downloaded == ["model.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json",
                          "model-1.safetensors"]
    assert model.config._name_or_path == "someone/sharded"


@pytest.mark.timeout(60)  # a regression reads gigabytes: fail instead
@pytest.mark.parametrize("ref", ["grown", "fifo"])
def test_the_hugging_face_cache_s_commit_record_is_read_once_and_bounded(ref: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's cache lookup reads ``refs/main`` whole, by name, before anything checks it:
    one grown to gigabytes took the memory of three times its size."""
    snapshot = _cached_hub_snapshot(tmp_path / "hub", "someone/refs", monkeypatch)
    _model_folder(tmp_path / "model")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (snapshot / name).write_bytes((tmp_path / "model" / name).read_bytes())
    main = snapshot.parent.parent / "refs" / "main"
    if ref == "grown":
        os.truncate(main, 2**31)  # sparse: no disk used
        said = "is 2 GiB, more than the 256 bytes such a file may be"
    else:
        main.unlink()
        os.mkfifo(main)
        said = "is a named pipe"
    with pytest.raises(TclightningError, match=f"record of the model's commit .*({said})"):
        load_model(ModelConfig(source="hf", name="someone/refs"))
    main.unlink()
    main.write_text("abc")
    assert load_model(ModelConfig(source="hf", name="someone/refs"))[0].config._name_or_path == "someone/refs"


@pytest.mark.timeout(60)  # a regression fills the disk: fail instead
def test_a_hub_model_file_is_downloaded_up_to_its_listed_size_no_further(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub sending a file as an endless compressed stream kept the pace on the bytes written
    (2 MB sent, 440 MiB on disk) for ever: each file stops at the size the hub lists for it, and a
    file listed without one is refused. Never through Xet storage, whose native writer ignored the
    limit (a terabyte named in its answer filled the disk)."""
    import huggingface_hub

    import tclightning.limits as limits
    import tclightning.models.loading as loading

    monkeypatch.setattr(limits, "_ABANDONED", [])  # this process's downloads given up on: none yet
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    _cached_hub_snapshot(tmp_path / "hub", "someone/endless", monkeypatch)
    listed = SimpleNamespace(sha="abc", siblings=[SimpleNamespace(rfilename="model.safetensors", size=10)])
    written = [0]

    def endless(*args: object, tqdm_class: type, **kwargs: object) -> None:
        assert huggingface_hub.constants.HF_HUB_DISABLE_XET  # over HTTP, where the size and the pace hold
        progress = tqdm_class(total=None, disable=True)
        while written[0] < 10**9:
            progress.update(100)
            written[0] += 100

    monkeypatch.setattr(loading, "hub_answer", lambda path, timeout_s=None: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, name, files_metadata: listed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", endless)
    with pytest.raises(TclightningError, match="its model.safetensors came larger than the 10 bytes the Hugging Face "
                                               r"Hub lists for it \(100 bytes\)"):
        load_model(ModelConfig(source="hf", name="someone/endless"))
    assert written[0] == 0  # stopped at its first bytes past the size
    assert not huggingface_hub.constants.HF_HUB_DISABLE_XET  # as it was, after the download
    from tclightning.network import hub_over_http

    monkeypatch.setattr(limits, "_ABANDONED", ["a download given up on, still running"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    with hub_over_http():
        pass
    assert huggingface_hub.constants.HF_HUB_DISABLE_XET  # never back on under the download still running
    listed.siblings[0].size = None
    with pytest.raises(TclightningError, match="lists no size for its model.safetensors; nothing was downloaded"):
        load_model(ModelConfig(source="hf", name="someone/endless"))


@pytest.mark.timeout(60)  # a regression waits on the hub: fail instead
@pytest.mark.parametrize("drip", ["one-file-listed-small", "one-file-listed-huge", "many-small-files"])
def test_a_hub_model_download_must_keep_up_a_rate(drip: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request of a download has a limit per read only: a hub dripping a byte every few
    seconds held the run for ever; a deadline from the size it lists is the hub's to choose, and
    one per file lets it list many small files, each dripped within its own. After its first 60 s
    the download must have come at 1 MiB/s, counted on the bytes received over all its files."""
    import time

    import huggingface_hub

    import tclightning.models.loading as loading

    snapshot = _cached_hub_snapshot(tmp_path / "hub", "someone/slow", monkeypatch)
    weights_bytes = 10**14 if drip == "one-file-listed-huge" else 2**20
    extra = [f"extra-{i}.json" for i in range(40)] if drip == "many-small-files" else []
    listed = SimpleNamespace(sha="abc", siblings=[SimpleNamespace(rfilename=name, size=weights_bytes if
                                                                  name == "model.safetensors" else 8)
                                                  for name in ["model.safetensors", *extra]])

    def dripping(name: str, filename: str, *, tqdm_class: type, **kwargs: object) -> str:
        progress = tqdm_class(total=8, disable=True)
        for _ in range(8 if filename in extra else 300):  # a byte every 0.1 s: far below the rate
            progress.update(1)
            time.sleep(0.1)
        (snapshot / filename).write_bytes(b"{}")
        return str(snapshot / filename)

    monkeypatch.setattr(network, "REMOTE_SETUP_S", 1.0)
    monkeypatch.setattr(loading, "hub_answer", lambda path, timeout_s=None: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, name, files_metadata: listed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", dripping)
    if extra:  # the weights come at once
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda name, filename, **kwargs: (
            dripping(name, filename, **kwargs) if filename in extra else
            ((snapshot / filename).write_bytes(b"w"), str(snapshot / filename))[1]))
    started = time.monotonic()
    with pytest.raises(TclightningError, match=r"its download fell below 1 MiB/s \(\d+ bytes in \d+ s, at "):
        load_model(ModelConfig(source="hf", name="someone/slow"))
    assert time.monotonic() - started < 10


def test_a_model_folder_holding_an_adapter_is_refused(tmp_path: Path) -> None:
    """transformers loads the base an adapter folder names (any folder, any hub name) with none of
    the folder's checks: a base of 40,000 layers built for minutes."""
    import json

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                            "base_model_name_or_path": str(tmp_path / "base")}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(TclightningError, match="holds a PEFT adapter .*give the base model as model.name"):
        load_model(ModelConfig(source="hf", name=str(folder)))


@pytest.mark.timeout(120)  # a regression opens the FIFO and waits: fail instead
@pytest.mark.parametrize("swapped", ["tokenizer.json", "config.json", "model.safetensors"])
def test_a_fifo_renamed_over_a_model_file_after_the_checks_is_never_opened(
        swapped: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers opened the folder's files by name after the checks: a FIFO renamed over one in
    between was waited on for ever. It reads the files as they were opened for the checks."""
    import tclightning.models.loading as loading

    folder = _model_folder(tmp_path / "model")
    check_folder = loading.check_model_folder

    def swapped_after_the_check(view: Path, trust_remote_code: bool = False) -> None:
        check_folder(view, trust_remote_code)
        os.mkfifo(tmp_path / "fifo")
        os.replace(tmp_path / "fifo", folder / swapped)

    monkeypatch.setattr(loading, "check_model_folder", swapped_after_the_check)
    model, tokenizer = load_model(ModelConfig(source="hf", name=str(folder)))
    assert tokenizer("1+1").input_ids and model.config._name_or_path == str(folder)


@pytest.mark.timeout(120)  # a regression waits on the server: fail instead
@pytest.mark.parametrize("service", ["mlflow-server", "hub-dataset"])
def test_a_server_that_answers_once_and_then_stalls_is_refused_within_the_setup_limit(
        service: str, once_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's check before the work got its answer; the work's own requests then waited for many
    minutes (MLflow: two minutes a request, seven retries; datasets: request after request)."""
    from tclightning.logging import build_loggers

    monkeypatch.setattr(network, "REMOTE_SETUP_S", 1.0)
    if service == "mlflow-server":
        recipe = to_dataclass(load_recipe("tiny"))
        recipe.logging.loggers = [{"class_path": "mlflow", "init_args": {"tracking_uri": once_server}}]
        require_logger_servers(recipe)  # answered: the check passes
        with pytest.raises(TclightningError, match=r"logging\.loggers\[0\].*gave no answer within 1 s"):
            build_loggers(recipe.logging.loggers, tmp_path / "run", "tiny")
    else:
        monkeypatch.setenv("HF_ENDPOINT", once_server)
        source = DataSource.from_config(TaskConfig(name="gsm8k", hf_name="nobody/no-such-dataset"), "gsm8k")
        with pytest.raises(TclightningError,
                           match="Hugging Face dataset nobody/no-such-dataset's splits gave no answer within 1 s"):
            source.splits()


@pytest.mark.timeout(60)  # a regression waits on the server: fail instead
@pytest.mark.parametrize("server", ["silent_server", "dripping_server"])
@pytest.mark.parametrize("thread", ["main", "worker"])
def test_each_request_to_a_webhdfs_store_has_a_time_limit(server: str, thread: str, request: pytest.FixtureRequest,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's webhdfs store sets no timeout on its requests: a server that stops answering held
    LightningCLI's ``--ckpt_path last`` (it lists the checkpoint folder before any hook) or a
    learning-rate finder removing its checkpoint, for ever; one that drips a byte at a time
    answers every read in time, so the whole request has a limit too, in any thread (Lightning's
    ``AsyncCheckpointIO`` saves from its own, and its teardown waited on it for ever)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from fsspec.implementations.webhdfs import WebHDFS

    monkeypatch.setattr(network, "REQUEST_TIMEOUT_S", 1)
    monkeypatch.setattr(network, "REQUEST_TOTAL_S", 2)
    unbounded = WebHDFS._connect
    host, port = request.getfixturevalue(server).removeprefix("http://").split(":")
    with network.remote_requests_bounded(), network.remote_requests_bounded():  # once is enough: bounded once
        store = WebHDFS(host, port=int(port), skip_instance_cache=True)
        started = time.monotonic()
        with pytest.raises((requests.exceptions.Timeout, TimeoutError)) as stalled:
            if thread == "main":
                store.ls("/checkpoints")
            else:
                with ThreadPoolExecutor(1) as worker:
                    worker.submit(store.ls, "/checkpoints").result()
    assert WebHDFS._connect is unbounded  # a program that called tclightning keeps its store as it was
    assert time.monotonic() - started < 10  # the dripping server drips for 20 s
    assert network.remote_failure(stalled.value).startswith("a remote store or server stopped answering")


def test_each_request_to_a_remote_store_has_a_time_limit(silent_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's http store waited five minutes a request (aiohttp's default), and MLflow two minutes
    and seven retries: a store that stalls mid-run ends the command, in one line. A limit set
    beforehand (fsspec's configuration, MLflow's variables) is kept."""
    import fsspec
    import fsspec.config

    yours = {"https": {"client_kwargs": {"trust_env": True}}}
    monkeypatch.setattr(fsspec.config, "conf", copy.deepcopy(yours))
    monkeypatch.setattr(network, "REQUEST_TIMEOUT_S", 1)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    with network.remote_requests_bounded():
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "1" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
        assert fsspec.config.conf["https"]["client_kwargs"]["trust_env"] is True
        store = fsspec.filesystem("http", skip_instance_cache=True)
        with pytest.raises(TimeoutError) as stalled:
            store.cat_file(f"{silent_server}/logs/metrics.csv")
    # a program of yours that called tclightning keeps its own settings, as they were
    assert fsspec.config.conf == yours and "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    reason = network.remote_failure(stalled.value)
    assert reason is not None and reason.startswith("a remote store or server stopped answering")
    assert network.remote_failure(ValueError("a bug")) is None


def test_every_parse_of_a_gguf_file_s_metadata_has_the_time_limit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file over 2 GiB is read where it lies, so bytes written into it after the config's and
    the tokenizer's reads are what the model's loading parses: that parse had no time limit (a
    claimed array of a billion entries takes hours). A parse slower than the limit stands in."""
    import time

    import gguf

    import tclightning.models.loading as loading

    monkeypatch.setattr(loading, "GGUF_METADATA_TIME_S", 1.0)
    monkeypatch.setattr(loading, "GGUF_COPIED_MAX_BYTES", 0)  # read where it lies, as a file over 2 GiB is
    parse, parses = gguf.GGUFReader.__init__, [0]

    def third_parse_slow(self, *args, **kwargs):
        parses[0] += 1
        if parses[0] == 3:  # the model's: after the config's and the tokenizer's
            time.sleep(10)
        parse(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", third_parse_slow)
    path = _gguf(tmp_path / "ok.gguf")
    started = time.monotonic()
    with pytest.raises(TclightningError, match="ok.gguf: reading its metadata took more than 1 s"):
        load_model(ModelConfig(source="gguf", gguf_file=str(path)))
    assert parses[0] == 3 and time.monotonic() - started < 10


def test_a_gguf_file_rewritten_in_place_between_its_reads_is_never_what_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers parses a GGUF file's metadata three times (config, tokenizer, model), the last
    with no time limit: bytes written into the file in between were parsed (a claimed array of a
    billion entries takes hours). It reads a copy made once, after the file was opened and checked."""
    import tclightning.models.loading as loading

    path = _gguf(tmp_path / "ok.gguf")
    metadata = loading._gguf_metadata
    reads = [0]

    def then_rewritten(read, what):
        found = metadata(read, what)
        reads[0] += 1
        if reads[0] == 1:  # after the config's read: the same file, written over in place
            with path.open("r+b") as same_file:
                same_file.write(b"GGUF" + b"\xff" * 64)
        return found

    monkeypatch.setattr(loading, "_gguf_metadata", then_rewritten)
    model, _ = load_model(ModelConfig(source="gguf", gguf_file=str(path)))
    assert model.config.num_hidden_layers == 1 and model.config._name_or_path == str(path)


def test_a_remote_setup_is_bounded_in_a_thread_of_your_program_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run(...)`` called from a thread of a program waited without end on a hub that answered
    once and then dripped: the setup's limit was an alarm, which only the main thread gets."""
    import threading

    import tclightning.limits as limits
    from tclightning.network import remote_setup

    monkeypatch.setattr(limits, "_ABANDONED", [])  # this process's work given up on: none yet
    stalled = threading.Event()
    raised = _raised_in_a_thread(lambda: remote_setup("the Hugging Face dataset foo/bar's files",
                                                      lambda: stalled.wait(60), timeout_s=0.5))
    stalled.set()
    assert isinstance(raised, TclightningError) and "foo/bar's files gave no answer within 0.5 s" in str(raised), raised


def test_a_hub_dataset_name_that_names_a_local_folder_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets reads a local folder named like the hub dataset first: a cloned repository's
    ``openai/gsm8k/`` in the working folder was trained on, unchecked, in place of the dataset."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    (tmp_path / "openai" / "gsm8k" / "train.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n')
    with pytest.raises(TclightningError, match="task.hf_name openai/gsm8k: names .*openai/gsm8k, which datasets "
                                               "would read instead of the Hugging Face dataset"):
        DataSource.from_config(TaskConfig(name="gsm8k", hf_name="openai/gsm8k"), "gsm8k")
    for reader in ("json", "CSV", "parquet"):  # datasets' readers of files, of the working folder's
        with pytest.raises(TclightningError, match=f"task.hf_name {reader}: is the name of datasets' {reader} reader"):
            DataSource.from_config(TaskConfig(name="gsm8k", hf_name=reader), "gsm8k")
    with pytest.raises(TclightningError, match="task.hf_name hf://datasets/json: a URL"):
        DataSource.from_config(TaskConfig(name="gsm8k", hf_name="hf://datasets/json"), "gsm8k")
