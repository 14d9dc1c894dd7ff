/* The engine's C entry points for other native libraries of the package (the TensorFlow op),
 * which cannot link to the Python module: tnt_notebook._native.c_api() returns the address of a
 * static tnt_c_api table, and the library receives it once through its tnt_bind() function. */
#ifndef TNT_C_API_H
#define TNT_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TNT_C_API_VERSION 3

typedef struct {
  const void* in;
  void* out;
  size_t bytes;
} tnt_piece;

/* Result codes of tnt_c_api.allreduce. */
enum {
  TNT_OK = 0,
  TNT_NO_ENGINE = 1,  /* no live engine in this process: use a rank function first */
  TNT_TIMEOUT = 2,    /* a peer did not arrive within the collective timeout */
  TNT_RANK_LOST = 3,  /* a peer died or left */
  TNT_ABORTED = 4,    /* another rank aborted the collective */
  TNT_MISMATCH = 5,   /* ranks called with different arguments */
  TNT_FAILED = 6      /* any other failure */
};

typedef struct {
  int version; /* TNT_C_API_VERSION */
  /* Allreduces `n` pieces (dtype and op codes as in _native.DTYPES / OPS) as fusion bucket
   * `bucket` on the process's current engine, without the GIL and without Python. Returns TNT_OK,
   * or an error code with a NUL-terminated message in `error`. */
  int (*allreduce)(const tnt_piece* pieces, size_t n, int dtype, int op, int64_t bucket,
                   char* error, size_t error_size);
  /* The same in two halves: start may post the exchange (reading the pieces' inputs) and writes
   * its ticket; finish, called in the order of the starts with the same pieces (inputs unchanged),
   * completes the call, or carries it out whole, and writes the pieces' outputs. */
  int (*start_allreduce)(const tnt_piece* pieces, size_t n, int dtype, int op, int64_t bucket,
                         int64_t* ticket, char* error, size_t error_size);
  int (*finish_allreduce)(int64_t ticket, const tnt_piece* pieces, size_t n, char* error,
                          size_t error_size);
  /* Records the time of a train step's mark `label` while the timeline records (else nothing). */
  void (*mark)(int64_t label);
} tnt_c_api;

#ifdef __cplusplus
}
#endif

#endif /* TNT_C_API_H */
