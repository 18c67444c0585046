/* Intel AMX for the CPU kernels: the tile registers, and the permission Linux wants before a
 * process touches them.
 *
 * HAVE_AMX is 1 where -march=native offers AMX-TILE and AMX-INT8 on Linux; amx_ready() then asks
 * the kernel once (arch_prctl ARCH_REQ_XCOMP_PERM: the tile data is a large piece of state that
 * Linux saves on a context switch only for a process that asked) and says whether it may.
 * A tile configuration is per thread: every thread loads one before its first tile instruction,
 * and releases its tiles when done, so a switch away saves nothing.
 */
#ifndef RAYLLM_CPU_AMX_H
#define RAYLLM_CPU_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && defined(__x86_64__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 once the kernel let this process use the tiles, else 0. Asked once; asking twice is harmless,
 * so the race between two threads' first calls is too. */
static int amx_ready(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* ldtilecfg's 64-byte operand, palette 1: for tile t, rows[t] rows of colsb[t] bytes. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

/* Every one of the 8 tiles 16 rows x 64 bytes: the largest tile, what the int8 GEMM uses. */
static inline void amx_load_full_tiles(void) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
static inline int amx_ready(void) { return 0; }
#endif

#endif
