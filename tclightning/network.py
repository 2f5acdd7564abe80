"""Bounded waits on the servers and stores a run talks to (the Hugging Face Hub, a W&B or MLflow
server, a logger's remote store): whether one answers at all, asked before the run starts (the
libraries that talk to them retry a silent host for minutes); a time limit on the setup work
done with one (:func:`remote_setup`); and a time limit on each request afterwards
(:func:`remote_requests_bounded`), so a server that answers and then stalls ends the command."""

from __future__ import annotations

import contextlib
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlparse

from tclightning.console import shown
from tclightning.errors import TclightningError
from tclightning.limits import waited_on

T = TypeVar("T")

ANSWER_TIMEOUT_S = 5.0
"""How long a server gets to answer one request (a hub answers in well under a second)."""

REMOTE_SETUP_S = 60.0
"""How long the setup done with one remote store or server may take (a logger's store listed for
its next version, an MLflow experiment looked up, a hub dataset's files resolved) before the
command refuses it: a server that answers once and then stalls was waited on without end."""

REQUEST_TIMEOUT_S = 30
"""How long one request to a remote store or server may wait to connect or for the next bytes of
its answer (an fsspec http(s) request: four times this in all), where the library's own default
waits five minutes or for ever (fsspec's http(s) stores; MLflow, which also retries seven times).
A limit you set yourself is kept."""

REQUEST_TOTAL_S = 4 * REQUEST_TIMEOUT_S
"""How long one whole request to a remote store may take: a server that drips a byte every few
seconds never trips the limit on each read."""

HUB_DOWNLOAD_MIN_BYTES_S = 2**20
"""The slowest a download from the Hugging Face Hub (a model's files, a dataset's) may be, on
average, once its first :data:`REMOTE_SETUP_S` are past: 1 MiB/s of bytes received over all its
files. A hub that drips a byte every few seconds trips no limit on each read, and a deadline from
the size it lists would be its own to choose. On a slower link, download first (``hf download``)."""


def keeps_pace(received: int, started: float) -> bool:
    """Whether a download that began at ``started`` (``time.monotonic()``) and has received
    ``received`` bytes keeps :data:`HUB_DOWNLOAD_MIN_BYTES_S`."""
    import time

    late_s = time.monotonic() - started - REMOTE_SETUP_S
    return late_s <= 0 or received >= late_s * HUB_DOWNLOAD_MIN_BYTES_S


_PLAIN_TOKEN = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{0,199}")


def _refused_path(what: str, value: str) -> TclightningError:
    return TclightningError(f"the Hugging Face Hub at {hub_url()} answered a file's {what} {shown(value[:80])!r}, "
                            "which is no hash but names a path; nothing was written from its answer")


def _refuse_path_commit(response: Any) -> None:
    """huggingface_hub's response hook: a commit header (``X-Repo-Commit``) that is not a plain token."""
    commit = response.headers.get("X-Repo-Commit")
    if commit is not None and not _PLAIN_TOKEN.fullmatch(commit):
        raise _refused_path("commit", commit)


async def _refuse_path_commit_async(response: Any) -> None:
    _refuse_path_commit(response)


def _refuse_path_sha(info_class: type) -> None:
    """``info_class`` (a repository's info, as huggingface_hub reads the Hugging Face Hub's answer)
    made only with a ``sha`` that is a plain token: ``datasets`` and a model's download take it for
    the revision (``refs/<revision>`` was written over any file it named). Checked where the answer
    has been read, so its encoding, size or transfer cannot hide it."""
    made = info_class.__init__

    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        sha = kwargs.get("sha")
        if isinstance(sha, str) and not _PLAIN_TOKEN.fullmatch(sha):
            raise _refused_path("commit", sha)
        made(self, *args, **kwargs)

    info_class.__init__ = checked  # type: ignore[misc]


def refuse_hub_paths() -> None:
    """From now on in this process, huggingface_hub refuses a file's ETag or a commit (a header's, a
    repository info's ``sha``) that is not a plain token (letters, digits, ``-``, ``_``). It names
    each download ``blobs/<ETag>`` in the cache, a file the Hugging Face Hub says is missing
    ``.no_exist/<commit>/<name>`` and a revision's record ``refs/<revision>``, unchecked: a hub answering
    one that is a path (``/home/you/.local/lib/.../x.pth``, ``../../x``) had its bytes (or an empty
    file) written there, code Python ran at its next start. The Hugging Face Hub's are hashes.
    Idempotent; it only adds the checks (your own client factory is kept, wrapped)."""
    from huggingface_hub import file_download
    from huggingface_hub.utils import _http

    normalize = file_download._normalize_etag
    if getattr(normalize, "refuses_paths", False):
        return

    def checked(etag: str | None) -> str | None:
        normalized = normalize(etag)
        if normalized is not None and not _PLAIN_TOKEN.fullmatch(normalized):
            raise _refused_path("ETag", normalized)
        return normalized

    def with_hook(factory: Callable[[], Any], hook: Callable[[Any], Any]) -> Callable[[], Any]:
        def made() -> Any:
            client = factory()
            client.event_hooks["response"] = [*client.event_hooks.get("response", []), hook]
            return client
        return made

    record_ref = file_download._cache_commit_hash_for_specific_revision

    def ref_within(storage_folder: str, revision: str, commit_hash: str) -> None:
        # where it is written, whatever answer it came from: a revision that leaves refs/ is refused
        refs = os.path.abspath(os.path.join(storage_folder, "refs"))
        where = os.path.abspath(os.path.join(refs, revision))
        if where == refs or os.path.commonpath([refs, where]) != refs:
            raise _refused_path("commit", revision)
        record_ref(storage_folder, revision, commit_hash)

    checked.refuses_paths = True  # type: ignore[attr-defined]
    file_download._normalize_etag = checked
    from huggingface_hub import hf_api

    for name in ("ModelInfo", "DatasetInfo", "SpaceInfo", "KernelInfo"):
        with contextlib.suppress(AttributeError):  # a kind of repository this release lacks
            _refuse_path_sha(getattr(hf_api, name))
    file_download._cache_commit_hash_for_specific_revision = ref_within
    with contextlib.suppress(ImportError, AttributeError):  # its own name for it, bound at its import
        from huggingface_hub import _snapshot_download

        _snapshot_download._cache_commit_hash_for_specific_revision = ref_within
    _http.set_client_factory(with_hook(_http._GLOBAL_CLIENT_FACTORY, _refuse_path_commit))  # the next session
    _http.set_async_client_factory(with_hook(_http._GLOBAL_ASYNC_CLIENT_FACTORY, _refuse_path_commit_async))


@contextlib.contextmanager
def hub_over_http() -> Iterator[None]:
    """huggingface_hub's downloads in the block go over HTTP, never through Xet storage: ``hf_xet``
    writes a file from native code that reports its progress to a callback whose error it prints
    and ignores, so neither a size limit nor a pace could stop it (a terabyte named in an Xet
    answer of the Hugging Face Hub filled the disk at disk speed)."""
    from huggingface_hub import constants

    from tclightning.limits import abandoned_work

    refuse_hub_paths()
    before, constants.HF_HUB_DISABLE_XET = constants.HF_HUB_DISABLE_XET, True
    try:
        yield
    finally:
        if not abandoned_work():  # a download given up on still runs: Xet stays off under it
            constants.HF_HUB_DISABLE_XET = before


HUB_URL = "https://huggingface.co"
WANDB_URL = "https://api.wandb.ai"


class NoAnswer(NamedTuple):
    """Why a server gave no HTTP answer: ``timed_out`` when it was reached, or tried, and kept
    silent (the case every client library waits out); otherwise it could not be reached at all."""

    reason: str
    timed_out: bool


def hub_url() -> str:
    """The Hugging Face Hub this process talks to (``$HF_ENDPOINT``, as huggingface_hub reads it)."""
    return os.environ.get("HF_ENDPOINT") or HUB_URL


def hub_offline() -> bool:
    """Whether huggingface_hub and datasets are told to stay offline (``HF_HUB_OFFLINE``)."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def is_http(url: str) -> bool:
    """Whether ``url`` is an http(s) URL as the clients read it (any case, blanks around it)."""
    return url.strip().lower().startswith(("http://", "https://"))


def host_of(url: str) -> str:
    """The host ``url`` names, or ``url`` itself when it names none or is malformed (``http://[::1``)."""
    try:
        return urlparse(url).hostname or url
    except ValueError:
        return url


def no_answer(url: str, timeout_s: float | None = None, client: Any = None) -> NoAnswer | None:
    """None when the server at ``url`` answers a ``GET`` within ``timeout_s`` (default
    :data:`ANSWER_TIMEOUT_S`) with any HTTP status (a 404 or a 401 is an answer: only its status
    line and headers are read); otherwise why not. ``client`` is the library's own HTTP client
    (huggingface_hub's session for the hub, an httpx-style ``stream``), so its proxies are the
    ones asked; by default ``urllib`` with the environment's proxies, ``ALL_PROXY`` included.

    The limit is on the whole answer: the clients' own limits are per read, and a server dripping
    an endless header a byte every few seconds never trips them
    (:func:`~tclightning.limits.waited_on`)."""
    timeout_s = ANSWER_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return waited_on(lambda: _ask(url, timeout_s, client), timeout_s)
    except TimeoutError:
        return NoAnswer(f"no answer within {timeout_s:g} s", True)


def _ask(url: str, timeout_s: float, client: Any) -> NoAnswer | None:
    """One ``GET`` of ``url`` for :func:`no_answer`, with the clients' own per-read limit."""
    try:
        if client is not None:
            with client.stream("GET", url, timeout=timeout_s):
                return None
        proxies = urllib.request.getproxies()
        for scheme in ("http", "https"):  # requests and httpx take ALL_PROXY for both; urllib for neither
            if "all" in proxies:
                proxies.setdefault(scheme, proxies["all"])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))
        with opener.open(urllib.request.Request(url), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except Exception as err:  # noqa: BLE001 - every failure to get an answer is the same verdict
        cause = getattr(err, "reason", None) or err.__cause__ or err.__context__
        if any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in (err, cause)):
            return NoAnswer(f"no answer within {timeout_s:g} s", True)
        reason = getattr(cause, "strerror", None) or " ".join(str(err).split()) or type(err).__name__
        return NoAnswer(reason, False)


def hub_answer(path: str, timeout_s: float | None = None) -> NoAnswer | None:
    """:func:`no_answer` for ``path`` on the Hugging Face Hub (e.g. ``api/models/NAME``), asked with
    huggingface_hub's own session."""
    from huggingface_hub.utils import get_session

    return no_answer(f"{hub_url().rstrip('/')}/{path}", timeout_s, get_session())


def remote_setup(what: str, work: Callable[[], T], timeout_s: float | None = None) -> T:
    """``work()``, which talks to a remote store or server, given :data:`REMOTE_SETUP_S` in any
    thread (:func:`~tclightning.limits.waited_on`: called from a thread of your program, it was
    unbounded); ``TclightningError`` naming ``what`` past it, or when the library's own time limit
    ends it first (``TimeoutError``)."""
    timeout_s = REMOTE_SETUP_S if timeout_s is None else timeout_s
    try:
        return waited_on(work, timeout_s)
    except TimeoutError:
        raise TclightningError(f"{what} gave no answer within {timeout_s:g} s; nothing was trained") from None


@contextlib.contextmanager
def remote_requests_bounded() -> Iterator[None]:
    """In the block each request to a remote store or server gets :data:`REQUEST_TIMEOUT_S`, where
    the library's own default waits minutes or for ever: fsspec's http(s) stores (a logger's
    ``save_dir``, a checkpoint ``dirpath``) and webhdfs store, and MLflow's tracking server (one
    retry). Settings you made yourself (fsspec's configuration, ``MLFLOW_HTTP_REQUEST_*``) are kept,
    and what the block set is taken back after it: a program of yours that called tclightning keeps
    its own settings."""
    import fsspec.config

    try:
        import aiohttp
    except ImportError:  # fsspec's http store needs it: without it there is no http store to bound
        aiohttp = None
    added: list[tuple[dict[str, Any], str]] = []  # (mapping, key) set here, taken back after

    def set_default(mapping: dict[str, Any], key: str, value: Any) -> Any:
        if key not in mapping:
            mapping[key] = value
            added.append((mapping, key))
        return mapping[key]

    if aiohttp is not None:
        limit = aiohttp.ClientTimeout(total=REQUEST_TOTAL_S, sock_connect=REQUEST_TIMEOUT_S,
                                      sock_read=REQUEST_TIMEOUT_S)
        for protocol in ("http", "https"):
            client = set_default(set_default(fsspec.config.conf, protocol, {}), "client_kwargs", {})
            set_default(client, "timeout", limit)
    set_default(os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))  # type: ignore[arg-type]
    set_default(os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # type: ignore[arg-type]
    unbound = _bound_webhdfs_requests()
    try:
        yield
    finally:
        for mapping, key in reversed(added):
            mapping.pop(key, None)
        if unbound is not None:
            unbound()


def _bound_webhdfs_requests() -> Callable[[], None] | None:
    """fsspec's webhdfs store sends every request through a ``requests`` session without a timeout:
    a server that stops answering held whatever asked it (LightningCLI resolving ``--ckpt_path
    last``, a learning-rate finder removing its checkpoint) for ever. Its sessions get
    :data:`REQUEST_TIMEOUT_S` to connect and for the next bytes, where a request names none, and
    :data:`REQUEST_TOTAL_S` for the whole request, in any thread (Lightning's ``AsyncCheckpointIO``
    saves from its own). Returns what puts the store back as it was (None: bounded already, or
    no webhdfs store)."""
    try:
        import requests
        from fsspec.implementations.webhdfs import WebHDFS
    except ImportError:  # no requests: no webhdfs store to bound
        return None
    if getattr(WebHDFS._connect, "requests_bounded", False):
        return None

    class BoundedSession(requests.Session):
        def request(self, *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", (REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_S))
            return waited_on(lambda: super(BoundedSession, self).request(*args, **kwargs), REQUEST_TOTAL_S)

    connect = WebHDFS._connect

    def bounded_connect(self: Any) -> None:
        connect(self)
        self.session.__class__ = BoundedSession  # its settings (auth, certificates) kept

    bounded_connect.requests_bounded = True  # type: ignore[attr-defined]
    WebHDFS._connect = bounded_connect

    def unbound() -> None:
        WebHDFS._connect = connect

    return unbound


_NETWORK_PACKAGES = frozenset({"socket", "ssl", "http", "urllib", "urllib3", "requests", "aiohttp", "httpx", "httpcore",
                               "fsspec", "s3fs", "gcsfs", "adlfs", "botocore", "mlflow", "wandb", "huggingface_hub"})


def _raised_in_network_code(err: BaseException) -> bool:
    """Whether ``err``, or an exception it was raised from or while handling, passed through a
    frame of the standard library's or a client library's network code."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0] in _NETWORK_PACKAGES:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def remote_failure(err: BaseException) -> str | None:
    """One line for ``err`` when it is a remote store or server that stopped answering or failed
    mid-command (a request past its time limit, a connection lost, MLflow's server refusing), else
    None. Libraries are looked up where already imported, never imported here."""
    import sys

    requests_exceptions = sys.modules.get("requests.exceptions")
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    remote = (TimeoutError, *(() if requests_exceptions is None else (requests_exceptions.RequestException,)),
              *(() if mlflow_exceptions is None else (mlflow_exceptions.MlflowException,)))
    if not isinstance(err, remote) or isinstance(err, TimeoutError) and not _raised_in_network_code(err):
        return None  # a timeout of your own code's (a lock, a callback's limit) is shown as it is
    detail = " ".join(str(err).split())[:200] or type(err).__name__
    return f"a remote store or server stopped answering or failed ({type(err).__name__}: {detail})"
