/* compare_params.c: compares two raw float32 parameter dumps (--dump-params).
 *
 * usage: compare_params A B [RTOL]   (RTOL 1e-5)
 * Equal when ||A - B|| <= RTOL * ||B|| and max|A - B| <= RTOL * max|B|: a
 * relative bound on the whole vector, so parameters that happen to sit near
 * zero do not turn rounding noise into a failure. Exit 0 equal, 1 different,
 * 2 unreadable or different sizes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float *slurp(const char *path, long *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    fseek(f, 0, SEEK_SET);
    float *v = bytes > 0 ? malloc(bytes) : NULL;
    if (!v || fread(v, 1, bytes, f) != (size_t)bytes || bytes % 4) {
        free(v);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *n = bytes / 4;
    return v;
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: compare_params A B [RTOL]\n");
        return 2;
    }
    double rtol = argc == 4 ? atof(argv[3]) : 1e-5;
    long na = 0, nb = 0;
    float *a = slurp(argv[1], &na), *b = slurp(argv[2], &nb);
    if (!a || !b || na != nb) {
        fprintf(stderr, "compare_params: cannot read %s and %s as equal-sized float arrays\n",
                argv[1], argv[2]);
        free(a), free(b);
        return 2;
    }
    double diff2 = 0, norm2 = 0, maxdiff = 0, maxb = 0;
    for (long i = 0; i < na; i++) {
        double d = fabs((double)a[i] - b[i]);
        diff2 += d * d;
        norm2 += (double)b[i] * b[i];
        maxdiff = d > maxdiff ? d : maxdiff;
        maxb = fabs(b[i]) > maxb ? fabs(b[i]) : maxb;
    }
    double rel = sqrt(diff2) / (sqrt(norm2) + 1e-30), relmax = maxdiff / (maxb + 1e-30);
    int equal = rel <= rtol && relmax <= rtol && isfinite(rel);
    printf("%ld parameters: relative L2 difference %.3g, relative max difference %.3g (%s %.1g)\n",
           na, rel, relmax, equal ? "within" : "NOT within", rtol);
    free(a), free(b);
    return equal ? 0 : 1;
}
