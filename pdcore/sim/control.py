"""The simulated control plane: frames between ranks, liveness by simulated heartbeats, and their faults.

``SimChannel`` offers what a driver performs on a control channel (``send``):
the frame is encoded and decoded on the way (``pdcore.control.wire``, as the
real channel does: a frame that cannot be encoded is refused at the sender), and
delivered after a delay to the rank behind the endpoint, unless a fault drops
it. Per (sender, receiver) frames keep their order, as one ZeroMQ connection
keeps them; a reordering fault holds a frame back so that frames on other links
overtake it. Frames may also be duplicated, or lost to a partition. Liveness follows the real channel's rule (``PeerLiveness``): every
``heartbeat`` each live rank is heard by the peers it talks to, if the link is
up; a peer silent for ``dead_after`` (killed, paused, partitioned) is reported
dead to the engines, once per incarnation, and one heard again is reported back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..control import wire
from ..control.liveness import PeerLiveness
from .world import World

__all__ = ["Network", "SimChannel", "ControlFaults"]


@dataclass
class ControlFaults:
    delay: float = 0.0005  # a frame's delay's scale (seconds)
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # share of frames held back (frames of other links overtake them)


class SimChannel:
    """One rank's end of the simulated control plane."""

    def __init__(self, network: Network, rank: Any, endpoint: str) -> None:
        self._network = network
        self.rank = rank
        self.endpoint = endpoint
        self.liveness = PeerLiveness(network.dead_after)
        network.channels[endpoint] = self

    def send(self, endpoint: str, msg: wire.Message) -> None:
        self._network.send(self, endpoint, msg)


class Network:
    def __init__(self, world: World, *, heartbeat: float, dead_after: float, wire_check: bool = True) -> None:
        self.world = world
        self.faults = ControlFaults()
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.wire_check = wire_check
        self.channels: dict[str, SimChannel] = {}
        self._last: dict[tuple[str, str], float] = {}  # per link: when its last in-order frame arrives
        self.cut: set[frozenset[str]] = set()  # links down (a partition)
        self.stats = {"sent": 0, "delivered": 0, "dropped": 0, "duplicated": 0, "reordered": 0, "cut": 0,
                      "heartbeats": 0}
        world.after(heartbeat, self._beat)

    def up(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut

    def send(self, channel: SimChannel, endpoint: str, msg: wire.Message) -> None:
        if self.wire_check:  # the real channel's rules: a frame that breaks them is refused at the sender
            msg = wire.decode(wire.encode(msg))
        world, f = self.world, self.faults
        self.stats["sent"] += 1
        channel.liveness.track(endpoint, world.now)
        copies = 2 if f.duplicate and world.rng.random() < f.duplicate else 1
        if copies == 2:
            self.stats["duplicated"] += 1
        for _ in range(copies):
            if f.drop and world.rng.random() < f.drop:
                self.stats["dropped"] += 1
                continue
            when = world.now + f.delay * (0.5 + world.rng.random())
            link = (channel.endpoint, endpoint)
            if f.reorder and world.rng.random() < f.reorder:  # held back: frames on other links overtake it
                self.stats["reordered"] += 1
                when += world.rng.random() * 20 * f.delay
            when = max(when, self._last.get(link, 0.0))  # one connection keeps its order (as ZeroMQ's does)
            self._last[link] = when
            world.at(when, self._deliver, channel.endpoint, endpoint, msg)

    def _deliver(self, sender: str, endpoint: str, msg: wire.Message) -> None:
        dst = self.channels.get(endpoint)
        if dst is None or not self.up(sender, endpoint):
            self.stats["cut"] += 1
            return
        self.stats["delivered"] += 1
        if type(msg) in (wire.Register, wire.EmbedRegister):
            self._introduce(dst, sender, msg.session_id, msg.epoch)  # type: ignore[union-attr]
        elif dst.rank.running:
            dst.liveness.heard(sender, self.world.now)
        dst.rank.frame(sender, msg)

    def _introduce(self, dst: SimChannel, sender: str, session_id: str, epoch: int) -> None:
        if not dst.rank.running:
            return
        back = dst.liveness.known(sender)[0] is None
        for dead in dst.liveness.introduced(sender, session_id, epoch, self.world.now):
            dst.liveness.forget(dead.endpoint)
            dst.rank.peer_dead(dead)
        if back:
            dst.rank.peer_back(sender, session_id, epoch)

    def _beat(self) -> None:
        """Every live rank's heartbeats to the peers it tracks, then every rank's verdicts."""
        now = self.world.now
        for endpoint, channel in list(self.channels.items()):
            rank = channel.rank
            if not rank.running:
                continue
            for peer in list(channel.liveness._peers):
                dst = self.channels.get(peer)
                if dst is None or not dst.rank.running or not self.up(endpoint, peer):
                    continue
                self.stats["heartbeats"] += 1
                self._introduce(dst, endpoint, rank.session_id, rank.epoch)  # the peer hears us
                dst.liveness.track(endpoint, now)  # and answers our heartbeats from then on
        for channel in list(self.channels.values()):
            if channel.rank.running:
                for dead in channel.liveness.expire(now):
                    channel.rank.peer_dead(dead)
        self.world.after(self.heartbeat, self._beat)

    def remove(self, endpoint: str) -> None:
        self.channels.pop(endpoint, None)

