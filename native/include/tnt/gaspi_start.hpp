#pragma once
// GPI-2's start-up: every rank is also a GASPI process whose GASPI rank is its MPI rank. Compiled
// with the GASPI calls only against an installed GPI-2 (TNT_WITH_GASPI); without it gaspi_start
// says so.
#include <mpi.h>

#include <functional>

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

}  // namespace tnt
