#pragma once
// Transport over GASPI (GPI-2) among processes that gaspi_start made GASPI processes: the
// inter-node allreduce is a ring of one-sided gaspi_write_notify transfers between GASPI segments,
// polled (never blocked on) from the engine's wait loop. Compiled with the GASPI calls only
// against an installed GPI-2 (TNT_WITH_GASPI).
#include <mpi.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "tnt/gaspi_start.hpp"
#include "tnt/transport.hpp"

namespace tnt {

// The ring allreduce among the members of `cross` (`world_ranks`: their ranks in the world that
// gaspi_start made GASPI processes), for at most `max_bytes` per call. Collective over `cross`;
// allocates a segment of its own that is never reused, even after the transport is gone.
std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm cross, std::vector<int> world_ranks,
                                                size_t max_bytes, double timeout_s,
                                                const MpiWait& wait);

}  // namespace tnt
