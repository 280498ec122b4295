// counted_prelude.h — included first by every counted copy: the shim in its
// counted variant (FMSIM_COUNTED_COPY) and every header the shaders include,
// so that the shader text can then sit in a namespace of its own (its
// templates must not merge at link time with the plain copy's).
#pragma once
#define FMSIM_COUNTED_COPY 1
#include "../../Resources/shaders/dialect.h"
#include "flashmetal_kernels.h"
