"""The one rule for names that look like they hold a credential.

A recipe refuses such an ``env`` entry (secrets come from the environment at run time), and the
trainer drops such keys from the config it logs to W&B. Words are matched whole where a part
would catch harmless names (``token`` but not ``tokenizer``, ``secret`` but not ``secretary``),
and anywhere where no harmless name holds them (``DBPASSWORD``, ``HFAPIKEY``).
"""

from __future__ import annotations

import re

WHOLE_WORDS = frozenset({"token", "secret", "secrets", "credential", "credentials"})
ANYWHERE = ("password", "passwd", "apikey", "api_key", "access_key", "private_key")


def looks_secret(name: str) -> bool:
    """Whether a variable or config key's name looks like it holds a credential: ``HF_TOKEN``,
    ``dbPassword``, ``WANDB_API_KEY``, ``AWS_ACCESS_KEY``, ``aws_secret_access_key``."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())
    joined = "_".join(words)
    return any(word in WHOLE_WORDS for word in words) or any(part in joined for part in ANYWHERE)
