"""The sampling defaults a checkpoint's ``generation_config.json`` recommends, applied
as vLLM applies them.

vLLM (``--generation-config auto``, its default) reads ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``)
from the file and uses them for what a request leaves unset: a request's own values
always win. ``--generation-config vllm`` ignores the file (Tandem's own defaults:
temperature 1, top_p 1, no top_k, min_p 0, repetition_penalty 1, 16 tokens), and a
directory reads that directory's ``generation_config.json`` instead. ``do_sample`` is
ignored, as vLLM ignores it: ``do_sample: false`` next to a temperature still samples
at that temperature (ask for ``temperature: 0`` to be greedy). ``top_k`` 0 or below
means no top-k filter, as in ``transformers``.

Where "unset" is decided: the router for both public APIs (proto3 ``optional`` fields;
the OpenAI bodies set only the fields a client sent), and the offline
``LLM.generate`` when it is given no ``SamplingParams`` (as vLLM's
``LLM.get_default_sampling_params()``). Torch-free.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.common.checkpoint_files import read_json
from tandem.common.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO = "auto"
"""Use the served checkpoint's ``generation_config.json`` (the default)."""
VLLM = "vllm"
"""Ignore it: Tandem's (and vLLM's) neutral defaults."""

_FILE_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""``generation_config.json`` key -> ``SamplingParams`` field."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request leaves unset; ``None``: the field keeps
    ``SamplingParams``' own default. Validated at construction, like ``SamplingParams``."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        SamplingParams(**self.given())  # raises ValueError naming a bad field

    def given(self) -> dict[str, float | int]:
        """The fields that have a default, by ``SamplingParams`` name."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def sampling_params(self) -> SamplingParams:
        """A request's parameters when it gives none (vLLM's
        ``get_default_sampling_params``)."""
        return SamplingParams(**self.given())

    @classmethod
    def from_file(cls, path: Path) -> SamplingDefaults:
        """The defaults in ``path`` (none when it is missing); a ``ValueError`` naming
        the file and the key for a value of the wrong type or out of range."""
        raw = read_json(path, required=False)
        values: dict[str, float | int | None] = {}
        for key, field in _FILE_FIELDS.items():
            value = raw.get(key)
            if value is None:
                continue
            integral = field in ("top_k", "max_tokens")
            if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
                kind = "an integer" if integral else "a number"
                raise ValueError(f"{path}: {key} must be {kind}, got {value!r}")
            values[field] = None if field == "top_k" and value <= 0 else value
        try:
            return cls(**values)
        except ValueError as err:
            name, _, problem = str(err).partition(" ")
            key = next((k for k, f in _FILE_FIELDS.items() if f == name), name)
            raise ValueError(f"{path}: {key} {problem}") from None


def load_sampling_defaults(setting: str, model_dir: str | Path) -> SamplingDefaults:
    """The defaults ``setting`` selects: ``auto`` (``model_dir``'s file), ``vllm`` (none),
    or a directory holding a ``generation_config.json``. Logs the defaults taken from a
    file, once per call (call it once at start-up)."""
    if setting == VLLM:
        return SamplingDefaults()
    directory = Path(model_dir) if setting == AUTO else Path(setting)
    if setting != AUTO and not directory.is_dir():
        raise ValueError(
            f"generation_config must be {AUTO!r}, {VLLM!r} or a directory holding "
            f"{GENERATION_CONFIG_FILE}, got {setting!r}"
        )
    path = directory / GENERATION_CONFIG_FILE
    defaults = SamplingDefaults.from_file(path)
    if given := defaults.given():
        shown = ", ".join(f"{k}={v}" for k, v in given.items())
        log.info(
            "Default sampling parameters from %s: %s (a request's own values win; "
            "--generation-config vllm ignores the file)",
            path,
            shown,
        )
    return defaults
