"""Where model weights come from, for every engine: a local directory, or a ModelScope id fetched ahead of time.

One policy: engines only `resolve` (never touching the network), turning each configured model
into a local directory or failing with one ModelNotAvailable naming the config key, the model id
and the command that fetches it. Downloads happen only when asked for: before a show, on a
machine with network,

    python -m voicebot.models fetch --config configs/a10.yaml

downloads every model the config names into its cache (with progress) and prints their sizes;
or, explicitly, `server.download_models: true` makes start-up run the same fetch first.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from voicebot.config import Settings, load_settings

# A downloaded snapshot holding these is complete; the first, the model's own config file, is what
# makes a local directory a model of its kind (its loader names any other file it misses).
FUNASR_FILES = ("config.yaml", "model.pt")
COSYVOICE2_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt")
MODELSCOPE_ID = re.compile(r"[\w.-]+/[\w.-]+")


class ModelNotAvailable(RuntimeError):
    """A configured model is neither a local directory nor in the cache (every engine raises this)."""


@dataclass(frozen=True)
class ModelRef:
    key: str  # the config key naming it, e.g. "asr.paraformer.model"
    ref: str  # a local directory or a ModelScope id
    cache: Path
    files: tuple[str, ...] = FUNASR_FILES  # what a complete snapshot holds

    @property
    def cached_dir(self) -> Path:
        return self.cache / self.ref


def is_complete(path: Path, files: tuple[str, ...] = FUNASR_FILES) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in files)


def resolve(model: ModelRef) -> Path:
    """The local directory of `model`; never touches the network."""
    local = Path(model.ref).expanduser()
    if local.is_dir():
        if not (local / model.files[0]).is_file():
            raise ModelNotAvailable(f"{model.key} = {model.ref!r} is a directory without {model.files[0]}: not a model")
        return local
    if not MODELSCOPE_ID.fullmatch(model.ref):
        raise ModelNotAvailable(f"{model.key} = {model.ref!r}: no such directory, and not a ModelScope id")
    if is_complete(model.cached_dir, model.files):
        return model.cached_dir
    raise ModelNotAvailable(
        f"{model.key} = {model.ref!r}: no such local directory and not downloaded into {model.cache}. "
        f"Fetch it on a machine with network: `python -m voicebot.models fetch --config <your config>` "
        f"(or `modelscope download --model {model.ref} --local_dir {model.cached_dir}`), "
        f"or set {model.key} to a local model directory."
    )


def required_models(settings: Settings) -> list[ModelRef]:
    """Every model the config's engines load at start-up."""
    refs: list[ModelRef] = []
    if settings.asr.engine in ("paraformer", "paraformer-batched"):
        conf = settings.asr.paraformer
        named = {
            "asr.paraformer.model": conf.model,
            "asr.paraformer.offline_model": conf.offline_model,
            "asr.paraformer.dialect.model": conf.dialect.model,
            "asr.paraformer.vad_model": conf.vad_model,
            "asr.paraformer.punc_model": conf.punc_model,
        }
        refs += [ModelRef(key, ref, conf.model_cache) for key, ref in named.items() if ref]
    if settings.tts.engine == "cosyvoice2":
        conf = settings.tts.cosyvoice2
        refs.append(ModelRef("tts.cosyvoice2.model", conf.model, conf.model_cache, COSYVOICE2_FILES))
    return refs


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fetch(model: ModelRef) -> Path:
    """Download `model` into its cache unless it is local or cached already (resumes a partial download)."""
    local = Path(model.ref).expanduser()
    if local.is_dir() or is_complete(model.cached_dir, model.files):
        return resolve(model)
    from modelscope import snapshot_download  # heavy, and only needed here

    model.cached_dir.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(model.ref, local_dir=str(model.cached_dir))  # a progress bar per file
    except Exception as exc:  # no network, unknown id, disk full: one line, not a traceback
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelNotAvailable(
            f"{model.key} = {model.ref!r}: downloading ModelScope model {model.ref!r} into {model.cached_dir} "
            f"failed ({type(exc).__name__}: {first_line})"
        ) from None
    if not is_complete(model.cached_dir, model.files):
        raise ModelNotAvailable(f"{model.key} = {model.ref!r}: download finished without {model.files}")
    return model.cached_dir


def fetch_all(settings: Settings) -> list[Path]:
    """Every model the config needs, downloaded where missing (`server.download_models`, and `fetch`)."""
    return [fetch(model) for model in required_models(settings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m voicebot.models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("fetch", "download every model the config needs"),
                            ("check", "say which models are present, without downloading")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--config", required=True, help="YAML config file, e.g. configs/a10.yaml")
    args = parser.parse_args(argv)

    models = required_models(load_settings(args.config))
    if not models:
        print(f"{args.config} needs no downloaded models.")
        return 0
    missing = 0
    total = 0
    for model in models:
        try:
            path = fetch(model) if args.command == "fetch" else resolve(model)
        except Exception as exc:  # report every model, then fail
            missing += 1
            print(f"MISSING  {model.key}: {exc}", file=sys.stderr)
            continue
        size = _size(path)
        total += size
        print(f"ok  {size / 1e6:9.1f} MB  {model.key} = {model.ref}  ->  {path}")
    print(f"{len(models) - missing}/{len(models)} models present, {total / 1e6:.1f} MB in all")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
