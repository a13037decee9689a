"""Several voicebot processes as one service: shared state in Redis (docs/deploy.md).

`Cluster` is what one process adds when `cluster.redis_url` is set: a RedisLink, a conversation
store that every server reads (resume lands anywhere), and a channel hub whose listeners hear the
speaker wherever it is. Without `redis_url` nothing here is used and the server runs alone, as before.
"""

from __future__ import annotations

from voicebot.cluster.channels import ClusterChannelHub
from voicebot.cluster.conversations import RedisConversationStore
from voicebot.cluster.link import CLUSTER_UNAVAILABLE, ClusterUnavailable, RedisLink, RedisLost
from voicebot.config import Settings
from voicebot.metrics import Metrics
from voicebot.reply.history import Conversation

__all__ = ["CLUSTER_UNAVAILABLE", "Cluster", "ClusterUnavailable", "RedisLost"]


class Cluster:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        reply = settings.reply
        self.link = RedisLink(settings.cluster, metrics.registry)
        self.channels = ClusterChannelHub(metrics, settings.server.max_listeners, self.link,
                                          settings.cluster.channel_owner_ttl_s)
        self.conversations = RedisConversationStore(
            self.link, reply.resume_ttl_s, reply.resume_max_conversations, settings.cluster.resume_wait_s,
            lambda: Conversation(reply.max_history_turns, reply.max_history_tokens))

    async def start(self) -> None:
        """Connect (ClusterUnavailable when Redis does not answer) and start publishing."""
        await self.link.start()
        self.channels.start()

    async def close(self) -> None:
        """After the sessions have closed: their conversations reach Redis, then the link closes."""
        await self.conversations.flush()
        await self.channels.close()
        await self.link.close()
