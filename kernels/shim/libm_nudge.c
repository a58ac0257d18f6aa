// libm_nudge.c: expf and logf K ulps from glibc's, for LD_PRELOAD (libm_nudge.h says why):
//   gcc -O2 -shared -fPIC -o libm_nudge.so kernels/shim/libm_nudge.c -ldl -lm
//   LD_PRELOAD=$PWD/libm_nudge.so NUDGE_ULPS=3 [NUDGE_SPREAD=1] gradbus run ...
// NUDGE_ULPS: K (default 3; negative: down); NUDGE_SPREAD set: -|K|..|K| by the argument. exp(0) = 1
// stays exact, as in every math library.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

#include "libm_nudge.h"

static float (*real_expf)(float), (*real_logf)(float);
static int ulps = 3, spread;

__attribute__((constructor)) static void init(void) {
    real_expf = (float (*)(float))dlsym(RTLD_NEXT, "expf");
    real_logf = (float (*)(float))dlsym(RTLD_NEXT, "logf");
    if (getenv("NUDGE_ULPS")) ulps = atoi(getenv("NUDGE_ULPS"));
    spread = getenv("NUDGE_SPREAD") != NULL;
}

float expf(float x) { return x == 0.0f ? 1.0f : libm_nudge(x, real_expf(x), ulps, spread); }
float logf(float x) { return libm_nudge(x, real_logf(x), ulps, spread); }
