"""Several emulated ranks in one process: a TorchAdapter whose collectives are
list exchanges, for tests that drive the library's transports end to end
without Horovod (the same paths run under horovodrun in tests/horovod/)."""
import torch

from hvd_compress.adapters.base import CallerInfo
from hvd_compress.adapters.torch_adapter import TorchAdapter
from hvd_compress.adapters.torch_collectives import TorchCollectives


class World:
    """What every emulated rank posted, by (collective kind, name)."""

    def __init__(self, size):
        self.size = size
        self.posted = {}

    def post(self, kind, name, rank, tensor):
        self.posted.setdefault((kind, name), {})[rank] = tensor.detach().clone()
        return kind, name


class InProcessCollectives(TorchCollectives):
    """The collectives of rank ``rank`` of ``world``: list exchanges."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def allgather(self, tensor, name, process_set):
        return self.world.post("allgather", name, self.rank, tensor)

    def allreduce_sum(self, tensor, name, process_set):
        return self.world.post("allreduce", name, self.rank, tensor)

    def alltoall(self, tensor, name, process_set):
        return self.world.post("alltoall", name, self.rank, tensor)

    def wait(self, handle):
        kind, name = handle
        posted = self.world.posted[handle]
        assert len(posted) == self.world.size, f"{name}: only ranks {sorted(posted)} posted"
        got = [posted[r] for r in range(self.world.size)]
        if kind == "allgather":
            return torch.cat(got)
        if kind == "allreduce":
            total = got[0]
            for t in got[1:]:  # in rank order, like the sums the tests compare with
                total = total + t
            return total
        # alltoall with equal splits: the slice of every sender's tensor meant for this rank
        m = got[0].numel() // self.world.size
        return torch.cat([t[self.rank * m:(self.rank + 1) * m] for t in got])


class InProcessAdapter(TorchAdapter):
    """Rank ``rank`` of ``world``; every tensor it compresses is keyed ``key``."""

    def __init__(self, world, rank, key="w"):
        super().__init__()
        self.roles.collectives = InProcessCollectives(world, rank)
        self.key = key

    # the world and rank are its collectives' (a test may move the adapter to another world)
    @property
    def world(self):
        return self.roles.collectives.world

    @world.setter
    def world(self, world):
        self.roles.collectives.world = world

    @property
    def rank(self):
        return self.roles.collectives.rank

    @rank.setter
    def rank(self, rank):
        self.roles.collectives.rank = rank

    def _caller_info(self, tensor):
        return CallerInfo(self.key, None, self.rank, self.world.size)

    def _check_fingerprint(self, comp, info):
        return None
