/* model.c: builds the MLP and the CNN as layer lists and runs them.
 *
 * MLP: [Linear, ReLU] per hidden size, then Linear to the classes.
 * CNN: two blocks of Conv(k, same padding) + ReLU + MaxPool(2), then the
 * MLP head on the flattened features. Activations are [B, C, H, W] rows, so
 * flattening is free. Forward keeps every layer's output; backward walks the
 * list in reverse and reports parameters as their gradients become final.
 */
#include "ductile/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/data.h"
#include "gpu.h"

static int add_param(model *m, const char *name, size_t numel)
{
    model_param *p = &m->params[m->nparams];
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->numel = numel;
    p->offset = m->nfloats;
    m->nfloats += numel;
    return m->nparams++;
}

static model_layer *add_layer(model *m, layer_kind kind, int in_size, int out_size)
{
    model_layer *l = &m->layers[m->nlayers++];
    memset(l, 0, sizeof(*l));
    l->kind = kind;
    l->in_size = in_size;
    l->out_size = out_size;
    l->wparam = l->bparam = -1;
    return l;
}

static void add_linear(model *m, int *size, int out, int index)
{
    char name[32];
    model_layer *l = add_layer(m, LAYER_LINEAR, *size, out);
    snprintf(name, sizeof(name), "fc%d.weight", index);
    l->wparam = add_param(m, name, (size_t)*size * out);
    snprintf(name, sizeof(name), "fc%d.bias", index);
    l->bparam = add_param(m, name, out);
    *size = out;
}

static void add_conv_block(model *m, int *c, int *h, int *w, int oc, int k, int index)
{
    char name[32];
    model_layer *l = add_layer(m, LAYER_CONV, *c * *h * *w, oc * *h * *w);
    conv_shape_init(&l->conv, *c, *h, *w, oc, k, k / 2);
    snprintf(name, sizeof(name), "conv%d.weight", index);
    l->wparam = add_param(m, name, (size_t)oc * *c * k * k);
    snprintf(name, sizeof(name), "conv%d.bias", index);
    l->bparam = add_param(m, name, oc);
    add_layer(m, LAYER_RELU, oc * *h * *w, oc * *h * *w);
    l = add_layer(m, LAYER_MAXPOOL, oc * *h * *w, oc * (*h / 2) * (*w / 2));
    l->c = oc;
    l->h = *h;
    l->w = *w;
    *c = oc;
    *h /= 2;
    *w /= 2;
}

static int check_config(const model_config *cfg, char *msg)
{
    if (cfg->kind != MODEL_MLP && cfg->kind != MODEL_CNN) {
        snprintf(msg, MODEL_MSG_MAX, "unknown model kind %d", cfg->kind);
        return -1;
    }
    if (cfg->in_c < 1 || cfg->in_h < 1 || cfg->in_w < 1 || cfg->classes < 2 || cfg->nhidden < 0 ||
        cfg->nhidden > MODEL_MAX_HIDDEN) {
        snprintf(msg, MODEL_MSG_MAX, "bad model shape");
        return -1;
    }
    for (int i = 0; i < cfg->nhidden; i++)
        if (cfg->hidden[i] < 1 || cfg->hidden[i] > 65536) {
            snprintf(msg, MODEL_MSG_MAX, "hidden size %d out of range 1..65536", cfg->hidden[i]);
            return -1;
        }
    if (cfg->kind == MODEL_CNN) {
        if (cfg->in_h % 4 || cfg->in_w % 4) {
            snprintf(msg, MODEL_MSG_MAX, "cnn needs image sides divisible by 4 (got %dx%d)",
                     cfg->in_h, cfg->in_w);
            return -1;
        }
        if (cfg->kernel < 1 || cfg->kernel > 9 || cfg->kernel % 2 == 0 || cfg->conv[0] < 1 ||
            cfg->conv[0] > 1024 || cfg->conv[1] < 1 || cfg->conv[1] > 1024) {
            snprintf(msg, MODEL_MSG_MAX, "bad conv settings (odd kernel 1..9, channels 1..1024)");
            return -1;
        }
    }
    return 0;
}

int model_create(const model_config *cfg, int max_batch, model **out, char *msg)
{
    *out = NULL;
    if (check_config(cfg, msg) != 0) return -1;
    model *m = calloc(1, sizeof(*m));
    if (!m) goto nomem;
    m->cfg = *cfg;
    m->max_batch = max_batch;
    int c = cfg->in_c, h = cfg->in_h, w = cfg->in_w;
    size_t col = 0;
    if (cfg->kind == MODEL_CNN)
        for (int i = 0; i < 2; i++) {
            add_conv_block(m, &c, &h, &w, cfg->conv[i], cfg->kernel, i + 1);
            size_t cs = conv_col_size(&m->layers[m->nlayers - 3].conv);
            col = cs > col ? cs : col;
        }
    int size = c * h * w;
    for (int i = 0; i < cfg->nhidden; i++) {
        add_linear(m, &size, cfg->hidden[i], i + 1);
        add_layer(m, LAYER_RELU, size, size);
    }
    add_linear(m, &size, cfg->classes, cfg->nhidden + 1);

    size_t in = (size_t)cfg->in_c * cfg->in_h * cfg->in_w;
    m->weights = calloc(m->nfloats, sizeof(float));
    m->own_grads = calloc(m->nfloats, sizeof(float));
    m->x = malloc(sizeof(float) * in * max_batch);
    m->y = malloc((size_t)max_batch);
    m->probs = malloc(sizeof(float) * cfg->classes * max_batch);
    if (!m->weights || !m->own_grads || !m->x || !m->y || !m->probs) goto nomem;
    if (col) {
        m->col = malloc(sizeof(float) * col);
        m->dcol = malloc(sizeof(float) * col);
        if (!m->col || !m->dcol) goto nomem;
    }
    for (int i = 0; i < m->nlayers; i++) {
        model_layer *l = &m->layers[i];
        l->out = malloc(sizeof(float) * l->out_size * max_batch);
        l->dout = malloc(sizeof(float) * l->out_size * max_batch);
        if (!l->out || !l->dout) goto nomem;
        if (l->kind == LAYER_MAXPOOL &&
            !(l->argmax = malloc(sizeof(int32_t) * l->out_size * max_batch)))
            goto nomem;
    }
    for (int i = 0; i < m->nparams; i++) {
        m->params[i].data = m->weights + m->params[i].offset;
        m->params[i].grad = m->own_grads + m->params[i].offset;
    }
    *out = m;
    return 0;
nomem:
    snprintf(msg, MODEL_MSG_MAX, "out of memory building the model");
    model_free(m);
    return -1;
}

void model_free(model *m)
{
    if (!m) return;
    gpu_detach(m);
    for (int i = 0; i < m->nlayers; i++) {
        free(m->layers[i].out);
        free(m->layers[i].dout);
        free(m->layers[i].argmax);
    }
    free(m->weights);
    free(m->own_grads);
    free(m->x);
    free(m->y);
    free(m->probs);
    free(m->col);
    free(m->dcol);
    free(m);
}

void model_describe(const model_config *cfg, char *buf, size_t len)
{
    int n = 0;
    if (cfg->kind == MODEL_CNN)
        n = snprintf(buf, len, "cnn %dx%dx%d k%d c%d-c%d fc", cfg->in_c, cfg->in_h, cfg->in_w,
                     cfg->kernel, cfg->conv[0], cfg->conv[1]);
    else
        n = snprintf(buf, len, "mlp %d", cfg->in_c * cfg->in_h * cfg->in_w);
    for (int i = 0; i < cfg->nhidden && n > 0 && (size_t)n < len; i++)
        n += snprintf(buf + n, len - n, "%s%d", (i || cfg->kind == MODEL_MLP) ? "-" : "",
                      cfg->hidden[i]);
    if (n > 0 && (size_t)n < len) snprintf(buf + n, len - n, "-%d", cfg->classes);
}

void model_init_params(model *m, uint64_t seed)
{
    uint64_t rng = seed;
    for (int i = 0; i < m->nlayers; i++) {
        model_layer *l = &m->layers[i];
        if (l->wparam < 0) continue;
        model_param *w = &m->params[l->wparam], *b = &m->params[l->bparam];
        float bound = 1.0f / sqrtf((float)(w->numel / b->numel)); /* 1/sqrt(fan_in) */
        for (size_t j = 0; j < w->numel; j++)
            w->data[j] = (2.0f * data_rng_uniform(&rng) - 1.0f) * bound;
        for (size_t j = 0; j < b->numel; j++)
            b->data[j] = (2.0f * data_rng_uniform(&rng) - 1.0f) * bound;
    }
}

static const float *layer_input(const model *m, int i)
{
    return i == 0 ? m->x : m->layers[i - 1].out;
}

const float *model_forward(model *m, int batch)
{
    if (m->dev) return gpu_forward(m, batch); /* device logits */
    for (int i = 0; i < m->nlayers; i++) {
        model_layer *l = &m->layers[i];
        const float *in = layer_input(m, i);
        switch (l->kind) {
        case LAYER_LINEAR:
            linear_forward(l->out, in, m->params[l->wparam].data, m->params[l->bparam].data, batch,
                           l->in_size, l->out_size);
            break;
        case LAYER_RELU:
            relu_forward(l->out, in, (size_t)batch * l->out_size);
            break;
        case LAYER_CONV:
            conv_forward(l->out, in, m->params[l->wparam].data, m->params[l->bparam].data, batch,
                         &l->conv, m->col);
            break;
        case LAYER_MAXPOOL:
            maxpool_forward(l->out, l->argmax, in, batch, l->c, l->h, l->w);
            break;
        }
    }
    return m->layers[m->nlayers - 1].out;
}

double model_loss(model *m, int batch)
{
    if (m->dev) return gpu_loss(m, batch);
    return softmax_xent_forward(m->probs, m->layers[m->nlayers - 1].out, m->y, batch,
                                m->cfg.classes);
}

int model_correct(const model *m, int batch)
{
    if (m->dev) return gpu_correct(m, batch);
    const float *z = m->layers[m->nlayers - 1].out;
    int k = m->cfg.classes, correct = 0;
    for (int i = 0; i < batch; i++) {
        int best = 0;
        for (int j = 1; j < k; j++)
            if (z[i * k + j] > z[i * k + best]) best = j;
        correct += best == m->y[i];
    }
    return correct;
}

void model_backward(model *m, int batch, float scale, model_ready_fn ready, void *ctx)
{
    if (m->dev) {
        gpu_backward(m, batch, scale, ready, ctx);
        return;
    }
    model_layer *last = &m->layers[m->nlayers - 1];
    softmax_xent_backward(last->dout, m->probs, m->y, batch, m->cfg.classes, scale);
    for (int i = m->nlayers - 1; i >= 0; i--) {
        model_layer *l = &m->layers[i];
        const float *in = layer_input(m, i);
        float *din = i > 0 ? m->layers[i - 1].dout : NULL;
        switch (l->kind) {
        case LAYER_LINEAR:
            linear_backward(din, m->params[l->wparam].grad, m->params[l->bparam].grad, l->dout, in,
                            m->params[l->wparam].data, batch, l->in_size, l->out_size);
            break;
        case LAYER_RELU:
            relu_backward(din, l->dout, l->out, (size_t)batch * l->out_size);
            break;
        case LAYER_CONV:
            conv_backward(din, m->params[l->wparam].grad, m->params[l->bparam].grad, l->dout, in,
                          m->params[l->wparam].data, batch, &l->conv, m->col, m->dcol);
            break;
        case LAYER_MAXPOOL:
            maxpool_backward(din, l->dout, l->argmax, batch, l->c, l->h, l->w);
            break;
        }
        if (l->wparam >= 0 && ready) {
            ready(ctx, l->bparam);
            ready(ctx, l->wparam);
        }
    }
}
