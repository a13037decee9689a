"""Where model weights come from: a local directory, or a ModelScope id fetched ahead of time.

The server never downloads on its own. At start-up `resolve` turns each configured model into a
local directory or fails with one message naming the config key, the model id and the command
that fetches it. Before a show, on a machine with network:

    python -m voicebot.models fetch --config configs/a10.yaml

downloads every model the config names into its cache (with progress) and prints their sizes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from voicebot.config import Settings, load_settings

# A directory holding these is a complete model snapshot of its kind.
FUNASR_FILES = ("config.yaml", "model.pt")
COSYVOICE2_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt")


class ModelNotAvailable(RuntimeError):
    """A configured model is neither a local directory nor in the cache."""


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
    if is_complete(local, model.files):
        return local
    if is_complete(model.cached_dir, model.files):
        return model.cached_dir
    if local.is_dir():
        raise ModelNotAvailable(
            f"{model.key} = {model.ref!r} is a directory without {' and '.join(model.files)}: not a model"
        )
    raise ModelNotAvailable(
        f"{model.key} = {model.ref!r}: no such local directory and not downloaded into {model.cache}. "
        f"Fetch it on a machine with network: `python -m voicebot.models fetch --config <your config>` "
        f"(or `modelscope download --model {model.ref} --local_dir {model.cached_dir}`), "
        f"or set {model.key} to a local model directory."
    )


def required_models(settings: Settings) -> list[ModelRef]:
    """Every model the config's engines load at start-up."""
    refs: list[ModelRef] = []
    if settings.asr.engine == "paraformer":
        conf = settings.asr.paraformer
        named = {
            "asr.paraformer.model": conf.model,
            "asr.paraformer.offline_model": conf.offline_model,
            "asr.paraformer.dialect.model": conf.dialect.model,
            "asr.paraformer.vad_model": conf.vad_model,
        }
        refs += [ModelRef(key, ref, conf.model_cache) for key, ref in named.items() if ref]
    if settings.tts.engine == "cosyvoice2":
        conf = settings.tts.cosyvoice2
        refs.append(ModelRef("tts.cosyvoice2.model", conf.model, conf.model_cache, COSYVOICE2_FILES))
    return refs


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fetch(model: ModelRef) -> Path:
    """Download `model` into its cache unless it is local already (resumes a partial download)."""
    local = Path(model.ref).expanduser()
    if is_complete(local, model.files):
        return local
    from modelscope import snapshot_download  # heavy, and only needed here

    model.cached_dir.mkdir(parents=True, exist_ok=True)
    # ModelScope shows a progress bar per file.
    snapshot_download(model.ref, local_dir=str(model.cached_dir))
    if not is_complete(model.cached_dir, model.files):
        raise ModelNotAvailable(f"{model.key} = {model.ref!r}: download finished without {model.files}")
    return model.cached_dir


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
