"""Whether a server a run depends on (the Hugging Face Hub, a W&B server) answers at all, asked
once before the run starts: the libraries that talk to them retry a silent host for minutes."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from typing import NamedTuple
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
    return urlparse(url).hostname or url


def no_answer(url: str, timeout_s: float | None = None) -> NoAnswer | None:
    """None when the server at ``url`` answers a ``HEAD`` request within ``timeout_s`` (default
    :data:`ANSWER_TIMEOUT_S`) with any HTTP status (a 404 or a 401 is an answer); otherwise why
    not. Proxies come from the environment, as for the libraries that will talk to it."""
    timeout_s = ANSWER_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as err:
        if isinstance(err.reason, (TimeoutError, socket.timeout)):
            return NoAnswer(f"no answer within {timeout_s:g} s", True)
        reason = err.reason.strerror if isinstance(err.reason, OSError) and err.reason.strerror else err.reason
        return NoAnswer(str(reason), False)
    except (TimeoutError, socket.timeout):
        return NoAnswer(f"no answer within {timeout_s:g} s", True)
    except (OSError, ValueError) as err:  # a connection cut mid-answer, a URL that is not one
        return NoAnswer(" ".join(str(err).split()) or type(err).__name__, False)
