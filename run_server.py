"""Start the voice server: python run_server.py [--config configs/default.yaml] [--host H] [--port P]."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import uvicorn

from voicebot.config import ConfigError, load_settings
from voicebot.config.base import DEFAULT_CONFIG
from voicebot.frontends.handshake import with_deadline
from voicebot.protocol import MAX_MESSAGE_BYTES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=os.environ.get("VOICEBOT_CONFIG", str(DEFAULT_CONFIG)))
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--ssl-certfile", help="serve https/wss with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    args = parser.parse_args()
    overrides = {"server": {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}}
    try:
        settings = load_settings(args.config, **overrides)
    except ConfigError as exc:
        print(f"voicebot: {exc}", file=sys.stderr)
        return 2
    # voicebot.app builds its module-level app from these at import: the same settings as ours.
    os.environ["VOICEBOT_CONFIG"] = args.config
    os.environ.update({f"VOICEBOT_SERVER__{k.upper()}": str(v) for k, v in overrides["server"].items()})
    try:
        from voicebot.app import create_app

        app = create_app(settings)
    except ConfigError as exc:  # e.g. exposed to the network with no token (docs/security.md)
        print(f"voicebot: {exc}", file=sys.stderr)
        return 2
    # uvicorn re-raises the SIGTERM it handled once it has stopped gracefully: a drained stop is a
    # success, so the re-raised signal exits 0 instead of killing the process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.log_level,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ws_max_size=MAX_MESSAGE_BYTES,  # over it: close 1009 (docs/protocol.md, Limits)
        # No permessage-deflate: it compressed every 200 ms PCM frame on the event loop (0.6-0.8 ms a
        # frame, ~12 % of the loop's busy time at 8 clients) to save a quarter of its bytes.
        ws_per_message_deflate=False,
        http=with_deadline(settings.server.handshake_timeout_s),  # idle and slowloris connections closed
        proxy_headers=False,  # the app trusts X-Forwarded-For only from server.trusted_proxies (voicebot/limits.py)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
