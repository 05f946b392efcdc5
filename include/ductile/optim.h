/* optim.h: SGD with momentum and AdamW (PyTorch's update rules), and the
 * warm-up + cosine learning-rate schedule.
 *
 * State is flat float arrays parallel to the model's flat parameter array
 * (param i's state at params[i].offset), so it checkpoints and broadcasts
 * as a few contiguous blocks.
 */
#ifndef DUCTILE_OPTIM_H
#define DUCTILE_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "ductile/model.h"

typedef enum { OPTIM_SGD = 0, OPTIM_ADAMW = 1 } optim_kind;

typedef struct optim_config {
    int kind;           /* optim_kind */
    float momentum;     /* SGD */
    float weight_decay; /* SGD: L2 added to the gradient; AdamW: decoupled */
    float beta1, beta2, eps;
} optim_config;

typedef struct optim {
    optim_config cfg;
    size_t n;     /* floats per state array */
    int nstate;   /* SGD: 1 (momentum buffer), AdamW: 2 (m, v) */
    float *state; /* nstate * n floats */
    int64_t t;    /* updates applied */
} optim;

int optim_create(const optim_config *cfg, size_t n, optim **out);
void optim_free(optim *o);
/* One update of every parameter of m with its gradient, at learning rate lr. */
void optim_step(optim *o, model *m, float lr);

/* The update of one flat array of n parameters p with gradient g (what
 * optim_step does per parameter, and the reference of the device kernels).
 * SGD's buf is its momentum buffer; AdamW's m and v its moment estimates,
 * bc1 and bc2 the bias corrections 1 - beta^t of this step. */
void optim_sgd_update(float *p, const float *g, float *buf, size_t n, float lr, float momentum,
                      float wd);
void optim_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr,
                        float beta1, float beta2, float eps, float wd, float bc1, float bc2);

/* Linear warm-up over warmup steps to base, then cosine decay to 0 as
 * progress goes from 0 to 1 (progress: fraction of the run's samples seen). */
float optim_lr(float base, int64_t step, int64_t warmup, double progress, int cosine);

#endif
