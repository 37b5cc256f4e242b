"""The protocol of each role as a sans-IO engine: inputs and time passed in, actions handed out.

- ``engine``: ``Services`` and the base every engine shares; ``actions``: what an engine hands out;
- ``prefill``, ``decode``, ``encode``, ``receiver``: one engine per role;
- ``lookups`` (asking bootstrap servers, two-phase), ``parking`` (announcements before their room
  registers), ``tombstones`` (rooms that failed), ``revokes`` (fences retried until they hold).

The peers drive these engines from one thread (``pdcore.node.driver``) through the scheduler-side
fronts (``pdcore.pd.front``, ``pdcore.epd.front``); the simulator (``pdcore.sim``) drives the same
fronts and engines over a seeded network, transport and clock.
"""
