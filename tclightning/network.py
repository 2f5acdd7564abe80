"""Whether a server a run depends on (the Hugging Face Hub, a W&B server) answers at all, asked
once before the run starts: the libraries that talk to them retry a silent host for minutes."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any, NamedTuple
from urllib.parse import urlparse

ANSWER_TIMEOUT_S = 5.0
"""How long a server gets to answer one request (a hub answers in well under a second)."""

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
    ones asked; by default ``urllib`` with the environment's proxies, ``ALL_PROXY`` included."""
    timeout_s = ANSWER_TIMEOUT_S if timeout_s is None else timeout_s
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
