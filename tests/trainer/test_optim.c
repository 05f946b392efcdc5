/* test_optim.c: optimizer updates and the learning-rate schedule against
 * values worked out by hand (torch.optim's formulas, in double).
 *
 * The model is a 1-input, 2-class linear layer, so fc1.weight and fc1.bias
 * are two parameters with separate offsets into the optimizer state: the
 * second gets a different gradient to show state is not shared.
 */
#include <string.h>

#include "ductile/model.h"
#include "ductile/optim.h"
#include "trainer_test.h"

static model *tiny(void)
{
    model *m;
    char msg[256];
    model_config cfg = {.kind = MODEL_MLP, .in_c = 1, .in_h = 1, .in_w = 1, .classes = 2};
    if (model_create(&cfg, 1, &m, msg) != 0) return NULL;
    for (size_t i = 0; i < m->nfloats; i++)
        m->weights[i] = 1.0f;
    return m;
}

static void set_grads(model *m, float w, float b)
{
    for (size_t i = 0; i < m->params[0].numel; i++)
        m->params[0].grad[i] = w;
    for (size_t i = 0; i < m->params[1].numel; i++)
        m->params[1].grad[i] = b;
}

static void test_sgd(void)
{
    model *m = tiny();
    optim *o;
    optim_config c = {.kind = OPTIM_SGD, .momentum = 0.9f, .weight_decay = 0.01f};
    CHECK(m && optim_create(&c, m->nfloats, &o) == 0, "create");
    /* step 1: d = 0.5 + 0.01*1 = 0.51, buf = 0.51, p = 1 - 0.1*0.51 = 0.949
     * step 2: d = 0.5 + 0.01*0.949 = 0.50949, buf = 0.9*0.51 + 0.50949 = 0.96849,
     *         p = 0.949 - 0.096849 = 0.852151 */
    set_grads(m, 0.5f, 0.0f);
    optim_step(o, m, 0.1f);
    CHECK(test_close(m->params[0].data[0], 0.949, 1e-7, 1e-6), "sgd step 1: %.7f",
          m->params[0].data[0]);
    optim_step(o, m, 0.1f);
    CHECK(test_close(m->params[0].data[1], 0.852151, 1e-7, 1e-6), "sgd step 2: %.7f",
          m->params[0].data[1]);
    /* bias, zero gradient: only decay. step 1: buf = 0.01, p = 0.999;
     * step 2: d = 0.00999, buf = 0.009 + 0.00999 = 0.01899, p = 0.999 - 0.001899 */
    CHECK(test_close(m->params[1].data[0], 0.997101, 1e-7, 1e-6), "sgd bias: %.7f",
          m->params[1].data[0]);
    CHECK(o->t == 2, "t = %lld", (long long)o->t);
    optim_free(o);
    model_free(m);
}

static void test_adamw(void)
{
    model *m = tiny();
    optim *o;
    optim_config c = {
        .kind = OPTIM_ADAMW, .weight_decay = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    CHECK(m && optim_create(&c, m->nfloats, &o) == 0, "create");
    CHECK(o->nstate == 2, "adamw keeps m and v");
    /* step 1 (g = 0.5): p = 0.999, m_hat = 0.5, v_hat = 0.25 -> p = 0.899
     * step 2 (g = -0.25): p = 0.8714672987 (worked in double) */
    set_grads(m, 0.5f, 0.0f);
    optim_step(o, m, 0.1f);
    CHECK(test_close(m->params[0].data[0], 0.899000002, 1e-6, 1e-6), "adamw step 1: %.7f",
          m->params[0].data[0]);
    set_grads(m, -0.25f, 0.0f);
    optim_step(o, m, 0.1f);
    CHECK(test_close(m->params[0].data[0], 0.8714672987, 1e-6, 1e-6), "adamw step 2: %.7f",
          m->params[0].data[0]);
    /* Zero gradient: only the decoupled decay, twice. */
    CHECK(test_close(m->params[1].data[0], 0.999 * 0.999, 1e-6, 1e-6), "adamw bias: %.7f",
          m->params[1].data[0]);
    optim_free(o);
    model_free(m);
}

static void test_schedule(void)
{
    CHECK(test_close(optim_lr(1.0f, 0, 10, 0.0, 1), 0.1, 1e-7, 0), "warm-up start");
    CHECK(test_close(optim_lr(1.0f, 4, 10, 0.0, 1), 0.5, 1e-7, 0), "warm-up middle");
    CHECK(test_close(optim_lr(1.0f, 9, 10, 0.0, 1), 1.0, 1e-7, 0), "warm-up end");
    CHECK(test_close(optim_lr(1.0f, 10, 10, 0.0, 1), 1.0, 1e-7, 0), "cosine start");
    CHECK(test_close(optim_lr(1.0f, 50, 10, 0.5, 1), 0.5, 1e-7, 0), "cosine middle");
    CHECK(test_close(optim_lr(1.0f, 50, 10, 0.25, 1), 0.5 * (1 + cos(M_PI / 4)), 1e-6, 0),
          "cosine quarter");
    CHECK(test_close(optim_lr(1.0f, 99, 10, 1.0, 1), 0.0, 1e-7, 0), "cosine end");
    CHECK(test_close(optim_lr(1.0f, 99, 10, 1.5, 1), 0.0, 1e-7, 0), "past the end");
    CHECK(test_close(optim_lr(0.3f, 99, 0, 0.7, 0), 0.3, 1e-7, 0), "constant");
}

int main(void)
{
    test_sgd();
    test_adamw();
    test_schedule();
    return check_finish("test_optim");
}
