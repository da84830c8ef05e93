"""The transport: Ray controller actors and worker groups, placement, ZeroMQ channels, remote
clients and the data-parallel router: how one engine spreads over a cluster."""
