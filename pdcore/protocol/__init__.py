"""The protocol of each role as a sans-IO engine: inputs and time passed in, actions handed out.

The peers drive these engines from one thread (``pdcore.node.driver``); the simulator
(``pdcore.sim``) drives the same engines over a seeded network, transport and clock.
"""
