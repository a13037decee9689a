"""The server's sections: what it listens on and admits (server, limits) and the cluster it joins."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, IPvAnyNetwork

from voicebot.config.base import REPO_ROOT, Section


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_sessions: int = Field(20, ge=1)
    # On SIGTERM: stop accepting sessions, let replies in progress finish for at most this long.
    shutdown_timeout_s: float = Field(10.0, ge=0)
    static_dir: Path = REPO_ROOT / "static"
    # Shared secret for exposed servers: every WebSocket (sessions, listeners, /obs/audio) must
    # present it (?token=, a `token.<TOKEN>` subprotocol, or `Authorization: Bearer`). None: open.
    # Set it through VOICEBOT_SERVER__TOKEN rather than in a committed file.
    token: str | None = Field(None, min_length=8)
    # With `token` set: a second token that opens /metrics only (a Prometheus scrape's bearer token),
    # so the scraper need not hold the one that drives the bot. /metrics takes either.
    metrics_token: str | None = Field(None, min_length=8)
    # Host names (Host header) the server answers to, besides IP addresses, localhost and `host`
    # itself: e.g. ["voice.example.com"], "*.example.com" for its subdomains, "*" for any. Any other
    # name is refused (403, WebSockets too): a web page on a domain made to resolve to this server
    # (DNS rebinding) would otherwise be "same-origin" with it. Probes (/healthz, /readyz) are exempt.
    allowed_hosts: list[str] = []
    # Listener connections (OBS overlays) across all channels; each queues at most ~600 KB.
    max_listeners: int = Field(50, ge=0)
    # Tests and troubleshooting only: keep the first N seconds of raw input of the 8 most recent
    # sessions in memory, served at /debug/input/{session_id}.wav. 0 = off (and no such route).
    record_input_s: float = Field(0.0, ge=0, le=60)
    # Download missing models (with progress) at start-up, as `python -m voicebot.models fetch`
    # does; off: start-up never touches the network and names what is missing.
    download_models: bool = False
    # Bound to anything but loopback without a token, the server refuses to start unless this is
    # set (then it warns): an open voice server on a network is anyone's (docs/security.md).
    allow_anonymous: bool = False
    # Web pages (Origin header) allowed to open a WebSocket, e.g. ["https://show.example.com"];
    # the server's own pages (same origin) always are, clients that send no Origin too. "*": any.
    allowed_origins: list[str] = []
    # A connection that has not sent session.start by then is closed (1008, start_timeout).
    start_timeout_s: float = Field(10.0, gt=0)
    # run_server.py: a TCP connection whose HTTP request head is not complete by then is closed
    # (one that sends nothing, slowloris); uvicorn alone waits for ever.
    handshake_timeout_s: float = Field(10.0, gt=0)
    # A started session on which the client has sent nothing (no audio, no event) for this long
    # while the bot is not replying is closed (1008, idle_timeout); so are /funasr connections.
    # Listeners are not sessions: they only receive. None: never.
    idle_timeout_s: float | None = Field(60.0, gt=0)
    # Per client address (voicebot/limits.py): WebSocket connections of every kind, and sessions
    # as max_sessions counts them. Past either: `busy`, close 1013. None: no limit. Loopback is an
    # address like any other.
    max_connections_per_client: int | None = Field(None, ge=1)
    max_sessions_per_client: int | None = Field(None, ge=1)
    # Proxies (addresses or CIDR networks) whose X-Forwarded-For names the client, e.g. the HAProxy
    # of deploy/haproxy; any other peer is the client itself, whatever it sends.
    trusted_proxies: list[IPvAnyNetwork] = []
    # FunASR's clients cannot present a token: with server.token set, clients in these networks use
    # the FunASR paths (/funasr, /, any path not served otherwise) without one. Nothing else does.
    funasr_tokenless_networks: list[IPvAnyNetwork] = []


class LimitsConfig(Section):
    """Flood protection: past these rates the session is closed (close code 4008)."""

    max_messages_per_s: float = Field(200.0, gt=0)
    # Audio bytes per second allowed, as a multiple of the session's real-time byte rate.
    max_audio_realtime_factor: float = Field(4.0, gt=1)
    # Each rate's allowance holds this long of it (voicebot/guards/flood.py): a client may catch up
    # after a network stall this long.
    window_s: float = Field(2.0, gt=0)
    # FunASR's clients send a file as fast as the server reads it (funasr-client in every mode, the
    # runtime's own clients in offline mode): this much audio more may come at once on /funasr.
    funasr_audio_burst_s: float = Field(60.0, ge=0)
    # A new session is refused (busy) when an engine thread pool that cannot batch would be busier
    # than this share of its threads' time with it (voicebot/serving/capacity.py).
    max_worker_load: float = Field(0.85, gt=0, le=1)
    # A chunk of input processed later than this after it arrived misses its deadline; a new session
    # is refused while more than 5 % of the last 5 s of chunks did (voicebot/serving/capacity.py).
    # A 20 ms chunk's trip through the front end, the VAD and the recognizer takes milliseconds on
    # an idle box; a listener hears the lag in every reply's start.
    max_input_lag_s: float = Field(0.25, gt=0)
    # Before a pool's cost per session is learnt, at most this many sessions are let in per 5 s.
    cold_start_sessions: int = Field(8, ge=1)


class ClusterConfig(Section):
    """Several voicebot processes sharing conversations and channels through Redis (docs/deploy.md).

    No `redis_url`: one process keeps everything in itself, as before. A configured Redis that
    cannot be reached stops start-up; one lost later leaves the process working on its own
    (error events, voicebot_cluster_redis_up 0) until it is back.
    """

    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0
    # Prefix of every key and pub/sub channel, so several shows can share one Redis (no glob
    # characters: servers subscribe to the pattern {prefix}ch:*).
    key_prefix: str = Field("voicebot:", pattern=r"^[A-Za-z0-9_.:-]+$")
    # A Redis call that takes longer counts as Redis lost. Redis on the same network answers in
    # well under 1 ms; this only has to outlast a stall of this server's own event loop.
    timeout_s: float = Field(2.0, gt=0)
    # A resumed conversation still held by a session on another server (its old socket not yet seen
    # closed, or that server draining) is waited for this long before the session starts without it.
    resume_wait_s: float = Field(3.0, ge=0)
    # While Redis is lost, a reconnection is tried this often.
    reconnect_interval_s: float = Field(1.0, gt=0)
    # A channel's owner key ({prefix}owner:NAME) expires this long after its server last renewed
    # it (every third of it, while the speaker is connected): a crashed server's channels are free
    # again after this long, and so are those of a server cut off from Redis for longer.
    channel_owner_ttl_s: float = Field(10.0, gt=0)
