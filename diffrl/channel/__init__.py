"""The channel: moves records between engines as they become ready."""

from diffrl.channel.local import Channel, ChannelClosed, StaleRecord

__all__ = ["Channel", "ChannelClosed", "StaleRecord"]
