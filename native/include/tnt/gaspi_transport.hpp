#pragma once
// Transport over GASPI (GPI-2): every rank is also a GASPI process whose GASPI rank is its MPI rank,
// and the inter-node allreduce is a ring of one-sided gaspi_write_notify transfers between GASPI
// segments, polled (never blocked on) from the engine's wait loop. Compiled with the GASPI calls
// only against an installed GPI-2 (TNT_WITH_GASPI); without it gaspi_start says so.
#include <mpi.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "tnt/transport.hpp"

namespace tnt {

// Whether this build has the GASPI transport.
bool gaspi_available();

// Waits for a nonblocking MPI operation within the caller's deadline; throws when it passes or
// the caller is interrupted.
using MpiWait = std::function<void(MPI_Request*, const char*)>;

// Makes every rank of `world` a GASPI process (GASPI rank = rank in `world`), collectively; on
// later calls only checks that every rank still is one. GPI-2 starts once per process and never
// again, so after a failure here the processes (the cluster) must be restarted. GPI-2's ports on
// each host lie in [port, port + kGaspiPortSpan); `port` 0 lets the ranks choose a range that is
// free on every host.
void gaspi_start(MPI_Comm world, int port, double timeout_s, const MpiWait& wait);
constexpr int kGaspiPortSpan = 384;

// The ring allreduce among the members of `cross` (`world_ranks`: their ranks in the world that
// gaspi_start made GASPI processes), for at most `max_bytes` per call. Collective over `cross`;
// allocates a segment of its own that is never reused, even after the transport is gone.
std::unique_ptr<Transport> make_gaspi_transport(MPI_Comm cross, std::vector<int> world_ranks,
                                                size_t max_bytes, double timeout_s,
                                                const MpiWait& wait);

}  // namespace tnt
