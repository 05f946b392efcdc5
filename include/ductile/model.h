/* model.h: the trainer's two models as a list of layers over flat arrays.
 *
 * Parameters live in one flat float array (params[i].data points into it);
 * gradients are separate pointers (params[i].grad) that the DDP reducer
 * re-points into its bucket memory, so backward writes straight into the
 * buffers that are all-reduced. Backward reports each parameter the moment
 * its gradient is final through a callback, which is how buckets start
 * their all-reduce while the rest of backward runs.
 */
#ifndef DUCTILE_MODEL_H
#define DUCTILE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "ductile/layers.h"

typedef enum { MODEL_MLP = 0, MODEL_CNN = 1 } model_kind;

#define MODEL_MAX_HIDDEN 8
#define MODEL_MAX_LAYERS 32
#define MODEL_MAX_PARAMS 32

typedef struct model_config {
    int kind;             /* model_kind */
    int in_c, in_h, in_w; /* input image */
    int classes;
    int nhidden; /* fully connected hidden layers */
    int hidden[MODEL_MAX_HIDDEN];
    int conv[2]; /* CNN: channels of the two conv blocks */
    int kernel;  /* CNN: square kernel, padded to keep the size */
} model_config;

typedef struct model_param {
    char name[32];
    size_t numel;
    size_t offset; /* into the flat parameter array */
    float *data;
    float *grad;
} model_param;

typedef enum { LAYER_LINEAR, LAYER_RELU, LAYER_CONV, LAYER_MAXPOOL } layer_kind;

typedef struct model_layer {
    layer_kind kind;
    int in_size, out_size; /* floats per sample */
    int c, h, w;           /* input shape (conv, max-pool) */
    conv_shape conv;
    int wparam, bparam; /* parameter indices, -1 if none */
    float *out, *dout;  /* max_batch * out_size each */
    int32_t *argmax;    /* max-pool */
} model_layer;

struct gpu_ctx;

typedef struct model {
    model_config cfg;
    int max_batch;
    int nlayers;
    model_layer layers[MODEL_MAX_LAYERS];
    int nparams;
    model_param params[MODEL_MAX_PARAMS];
    size_t nfloats;   /* total parameter floats */
    float *weights;   /* the flat parameter array */
    float *own_grads; /* gradient memory until a reducer provides its own */
    float *x;         /* input batch: max_batch * in_c*in_h*in_w */
    uint8_t *y;       /* labels */
    float *probs;     /* max_batch * classes */
    float *col, *dcol;
    struct gpu_ctx *dev; /* on a CUDA device (gpu.h) when set; NULL on the CPU */
} model;

/* The size of the msg buffer model_create fills with a one-line reason. */
#define MODEL_MSG_MAX 256

/* Returns 0, or -1 with a one-line reason in msg (MODEL_MSG_MAX bytes). */
int model_create(const model_config *cfg, int max_batch, model **out, char *msg);
void model_free(model *m);
/* "mlp 784-256-128-10", "cnn 1x28x28 c16-c32 fc128-10" */
void model_describe(const model_config *cfg, char *buf, size_t len);

/* PyTorch's default initialisation (uniform +-1/sqrt(fan_in)), seeded. */
void model_init_params(model *m, uint64_t seed);

/* Forward of m->x[0..batch): returns the logits (batch * classes). */
const float *model_forward(model *m, int batch);
/* Sum of the cross-entropy losses of the last forward against m->y. */
double model_loss(model *m, int batch);
/* Samples of the last forward whose arg-max is the label. */
int model_correct(const model *m, int batch);

typedef void (*model_ready_fn)(void *ctx, int param);
/* Backward of the last forward and loss; gradients are ADDED to params[].grad
 * with the loss scaled by `scale`; ready(ctx, i) is called for each parameter,
 * in reverse order, as soon as its gradient is final. */
void model_backward(model *m, int batch, float scale, model_ready_fn ready, void *ctx);

#endif
