/* optim.c: the update rules, written to match torch.optim exactly.
 *
 * SGD (dampening 0, no Nesterov): g += wd*p; buf = momentum*buf + g;
 * p -= lr*buf. A zero buffer makes the first step buf = g, as PyTorch's
 * lazily created buffer does.
 * AdamW: p *= 1 - lr*wd; m, v moving averages; bias-corrected step
 * p -= lr * m_hat / (sqrt(v_hat) + eps).
 */
#include "ductile/optim.h"

#include <math.h>
#include <stdlib.h>

#include "gpu.h"

int optim_create(const optim_config *cfg, size_t n, optim **out)
{
    optim *o = calloc(1, sizeof(*o));
    if (!o) return -1;
    o->cfg = *cfg;
    o->n = n;
    o->nstate = cfg->kind == OPTIM_ADAMW ? 2 : 1;
    o->state = calloc(o->nstate * n, sizeof(float));
    if (!o->state) {
        free(o);
        return -1;
    }
    *out = o;
    return 0;
}

void optim_free(optim *o)
{
    if (!o) return;
    free(o->state);
    free(o);
}

void optim_sgd_update(float *p, const float *g, float *buf, size_t n, float lr, float momentum,
                      float wd)
{
    for (size_t i = 0; i < n; i++) {
        float d = g[i] + wd * p[i];
        buf[i] = momentum * buf[i] + d;
        p[i] -= lr * buf[i];
    }
}

void optim_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr,
                        float beta1, float beta2, float eps, float wd, float bc1, float bc2)
{
    float decay = 1.0f - lr * wd;
    float step = lr / bc1, bc2_sqrt = sqrtf(bc2);
    for (size_t i = 0; i < n; i++) {
        p[i] *= decay;
        m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
        v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
        p[i] -= step * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
    }
}

void optim_step(optim *o, model *mdl, float lr)
{
    o->t++;
    float bc1 = 1.0f - powf(o->cfg.beta1, (float)o->t);
    float bc2 = 1.0f - powf(o->cfg.beta2, (float)o->t);
    if (mdl->dev) {
        gpu_optim_step(mdl, o, lr, bc1, bc2);
        return;
    }
    for (int i = 0; i < mdl->nparams; i++) {
        model_param *p = &mdl->params[i];
        float *s0 = o->state + p->offset;
        const optim_config *c = &o->cfg;
        if (c->kind == OPTIM_SGD)
            optim_sgd_update(p->data, p->grad, s0, p->numel, lr, c->momentum, c->weight_decay);
        else
            optim_adamw_update(p->data, p->grad, s0, s0 + o->n, p->numel, lr, c->beta1, c->beta2,
                               c->eps, c->weight_decay, bc1, bc2);
    }
}

float optim_lr(float base, int64_t step, int64_t warmup, double progress, int cosine)
{
    if (step < warmup) return base * (float)(step + 1) / (float)warmup;
    if (!cosine) return base;
    if (progress > 1.0) progress = 1.0;
    return (float)(base * 0.5 * (1.0 + cos(M_PI * progress)));
}
