/* router._splice: the decode stream's per-read work in C (optional; router/relay.py falls back
 * to Python without it).
 *
 * One `Relay` per relayed stream. While the engine connection's HTTP parser sits between two
 * chunks of a chunked body and relay._Splice saw the stream end on an SSE event boundary,
 * `Relay.feed(data)` takes a read that is a run of whole, non-empty chunks whose payload ends on
 * an event boundary and carries no "usage", and in one call: checks the framing, counts the
 * SSE events (tokens) and [DONE], does the TTFT/ITL bookkeeping of relay.Tally.tick, writes
 * the payload to the client's transport as ONE chunk (the read itself when it is one chunk)
 * and reports the client's backpressure. Any other read (a partial chunk, the last chunk,
 * chunk extensions, usage, anything odd) returns SLOW without side effects, and the Python
 * path (httptools, relay._Splice) takes it as before: the parser never saw the fast reads,
 * and they ended on a chunk boundary, so its state is what it was.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>

#define R_SLOW 1
#define R_PAUSED 2
#define R_FLUSH 4
#define ITL_FLUSH 64
#define MAX_SIZE_DIGITS 8

static PyObject *s_is_closing, *s_write, *s_write_paused;

typedef struct {
    PyObject_HEAD
    PyObject *transport; /* the client's transport: .write(bytes), .is_closing() */
    PyObject *flow;      /* the client connection's flow control: .write_paused */
    double *bounds;      /* the ITL histogram's upper bounds (last one +inf) */
    long long *counts;   /* batched ITL observations per bucket */
    Py_ssize_t nb;
    double sum;
    long pending;
    double t0, ttft, last, gaps, max_gap, last_read;
    int has_ttft, seen_done;
    long long chunks; /* token events seen (TTFT's event included) */
    long long fast_reads;
} Relay;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter and time.monotonic on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* relay.Tally.tick: `events` token events reached the client at `now`; returns R_FLUSH when
 * ITL_FLUSH observations are batched. */
static int tick(Relay *r, double now, long long events) {
    double share;
    Py_ssize_t lo, hi;
    if (events <= 0) return 0;
    if (!r->has_ttft) {
        r->has_ttft = 1;
        r->ttft = now - r->t0;
        r->chunks = 1;
        events -= 1;
        share = 0.0;
        if (!events) {
            r->last = now;
            return 0;
        }
    } else {
        share = (now - r->last) / (double)events;
    }
    r->last = now;
    r->gaps += share * (double)events;
    if (share > r->max_gap) r->max_gap = share;
    r->chunks += events;
    lo = 0; /* bisect_left(bounds, share): the first bucket whose bound is >= share */
    hi = r->nb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (r->bounds[mid] < share) lo = mid + 1; else hi = mid;
    }
    if (lo >= r->nb) lo = r->nb - 1;
    r->counts[lo] += events;
    r->sum += share * (double)events;
    r->pending += (long)events;
    return r->pending >= ITL_FLUSH ? R_FLUSH : 0;
}

/* Token events in a payload that starts and ends on an event boundary (relay.token_events):
 * blank lines end events; a final "data: [DONE]\n\n" is not a token. */
static long long count_events(const char *p, Py_ssize_t n, int *done) {
    long long events = 0;
    const char *end = p + n, *q = p;
    while (q < end) {
        const char *hit = memmem(q, (size_t)(end - q), "\n\n", 2);
        if (!hit) break;
        events++;
        q = hit + 2;
    }
    *done = n >= 14 && memcmp(end - 14, "data: [DONE]\n\n", 14) == 0;
    return events - *done;
}

static int Relay_init(Relay *r, PyObject *args, PyObject *kw) {
    static char *names[] = {"transport", "flow", "bounds", "t0", NULL};
    PyObject *transport, *flow, *bounds, *seq;
    double t0;
    Py_ssize_t i, n;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOd", names, &transport, &flow, &bounds, &t0)) return -1;
    seq = PySequence_Fast(bounds, "bounds must be a sequence of floats");
    if (!seq) return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "bounds is empty");
        return -1;
    }
    PyMem_Free(r->bounds);
    PyMem_Free(r->counts);
    r->bounds = PyMem_Calloc((size_t)n, sizeof(double));
    r->counts = PyMem_Calloc((size_t)n, sizeof(long long));
    if (!r->bounds || !r->counts) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++) {
        r->bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (r->bounds[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    r->nb = n;
    Py_INCREF(transport);
    Py_XSETREF(r->transport, transport);
    Py_INCREF(flow);
    Py_XSETREF(r->flow, flow);
    r->t0 = t0;
    return 0;
}

static int Relay_traverse(Relay *r, visitproc visit, void *arg) {
    Py_VISIT(r->transport);
    Py_VISIT(r->flow);
    return 0;
}

static int Relay_clear(Relay *r) {
    Py_CLEAR(r->transport);
    Py_CLEAR(r->flow);
    return 0;
}

static void Relay_dealloc(Relay *r) {
    PyObject_GC_UnTrack(r);
    Relay_clear(r);
    PyMem_Free(r->bounds);
    PyMem_Free(r->counts);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Write `out` to the client unless its transport is closing; then the backpressure flag. */
static int deliver(Relay *r, PyObject *out) {
    PyObject *res;
    int closing, paused;
    if (!r->transport) return 0; /* closed: nowhere to go */
    res = PyObject_CallMethodNoArgs(r->transport, s_is_closing);
    if (!res) return -1;
    closing = PyObject_IsTrue(res);
    Py_DECREF(res);
    if (closing < 0) return -1;
    if (closing) return 0; /* the client left; its connection_lost cancels the request */
    res = PyObject_CallMethodOneArg(r->transport, s_write, out);
    if (!res) return -1;
    Py_DECREF(res);
    res = PyObject_GetAttr(r->flow, s_write_paused);
    if (!res) return -1;
    paused = PyObject_IsTrue(res);
    Py_DECREF(res);
    if (paused < 0) return -1;
    return paused ? R_PAUSED : 0;
}

static PyObject *Relay_feed(Relay *r, PyObject *data) {
    const char *d;
    Py_ssize_t n, pos = 0, payload = 0, nchunks = 0, first_at = 0;
    PyObject *out;
    const char *body;
    long long events;
    int done = 0, rc, flags;
    double now;
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes bytes");
        return NULL;
    }
    d = PyBytes_AS_STRING(data);
    n = PyBytes_GET_SIZE(data);
    /* pass 1: a run of whole, non-empty chunks without extensions, or SLOW */
    while (pos < n) {
        Py_ssize_t size = 0;
        int digits = 0, v;
        while (pos < n && digits <= MAX_SIZE_DIGITS && (v = hexval((unsigned char)d[pos])) >= 0) {
            size = size * 16 + v;
            pos++;
            digits++;
        }
        if (digits == 0 || digits > MAX_SIZE_DIGITS || size == 0) return PyLong_FromLong(R_SLOW);
        if (pos + 2 > n || d[pos] != '\r' || d[pos + 1] != '\n') return PyLong_FromLong(R_SLOW);
        pos += 2;
        if (size > n - pos - 2 || d[pos + size] != '\r' || d[pos + size + 1] != '\n')
            return PyLong_FromLong(R_SLOW);
        if (nchunks == 0) first_at = pos;
        nchunks++;
        payload += size;
        pos += size + 2;
    }
    if (nchunks == 0) return PyLong_FromLong(R_SLOW);
    /* pass 2: the payload as one chunk (a single-chunk read is passed on as it came) */
    if (nchunks == 1) {
        Py_INCREF(data);
        out = data;
        body = d + first_at;
    } else {
        char head[24];
        int hl = snprintf(head, sizeof head, "%zx\r\n", (size_t)payload);
        char *o;
        out = PyBytes_FromStringAndSize(NULL, hl + payload + 2);
        if (!out) return NULL;
        o = PyBytes_AS_STRING(out);
        memcpy(o, head, (size_t)hl);
        body = o + hl;
        o += hl;
        pos = 0;
        while (pos < n) {
            Py_ssize_t size = 0;
            int v;
            while ((v = hexval((unsigned char)d[pos])) >= 0) {
                size = size * 16 + v;
                pos++;
            }
            pos += 2;
            memcpy(o, d + pos, (size_t)size);
            o += size;
            pos += size + 2;
        }
        o[0] = '\r';
        o[1] = '\n';
    }
    /* usage: relay._Splice rewrites it. Not ending on an event boundary (an engine whose HTTP
     * chunks are not whole events): the Python path counts events cut across reads. */
    if (payload < 2 || body[0] == '\n' || body[payload - 1] != '\n' || body[payload - 2] != '\n' ||
        memmem(body, (size_t)payload, "usage", 5) != NULL) {
        Py_DECREF(out);
        return PyLong_FromLong(R_SLOW);
    }
    events = count_events(body, payload, &done);
    now = now_s();
    r->last_read = now;
    r->fast_reads++;
    if (done) r->seen_done = 1;
    flags = tick(r, now, events);
    rc = deliver(r, out);
    Py_DECREF(out);
    if (rc < 0) return NULL;
    return PyLong_FromLong(flags | rc);
}

static PyObject *Relay_tick(Relay *r, PyObject *const *args, Py_ssize_t nargs) {
    long long events;
    double now;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "tick(events, now=None)");
        return NULL;
    }
    events = PyLong_AsLongLong(args[0]);
    if (events == -1 && PyErr_Occurred()) return NULL;
    if (nargs == 2 && args[1] != Py_None) {
        now = PyFloat_AsDouble(args[1]);
        if (now == -1.0 && PyErr_Occurred()) return NULL;
    } else {
        now = now_s();
    }
    return PyLong_FromLong(tick(r, now, events));
}

static PyObject *Relay_take(Relay *r, PyObject *unused) {
    /* (per-bucket counts, sum) of the batched ITL observations; resets them */
    PyObject *counts = PyList_New(r->nb), *res;
    Py_ssize_t i;
    if (!counts) return NULL;
    for (i = 0; i < r->nb; i++) {
        PyObject *c = PyLong_FromLongLong(r->counts[i]);
        if (!c) {
            Py_DECREF(counts);
            return NULL;
        }
        PyList_SET_ITEM(counts, i, c);
    }
    res = Py_BuildValue("(Nd)", counts, r->sum);
    if (!res) return NULL;
    memset(r->counts, 0, sizeof(long long) * (size_t)r->nb);
    r->sum = 0.0;
    r->pending = 0;
    return res;
}

static PyObject *Relay_close(Relay *r, PyObject *unused) {
    Relay_clear(r);
    Py_RETURN_NONE;
}

static PyObject *Relay_get_ttft(Relay *r, void *c) {
    if (!r->has_ttft) Py_RETURN_NONE;
    return PyFloat_FromDouble(r->ttft);
}

static PyObject *Relay_get_gaps(Relay *r, void *c) { return PyFloat_FromDouble(r->gaps); }
static PyObject *Relay_get_max_gap(Relay *r, void *c) { return PyFloat_FromDouble(r->max_gap); }
static PyObject *Relay_get_chunks(Relay *r, void *c) { return PyLong_FromLongLong(r->chunks); }
static PyObject *Relay_get_seen_done(Relay *r, void *c) { return PyBool_FromLong(r->seen_done); }
static PyObject *Relay_get_last_read(Relay *r, void *c) { return PyFloat_FromDouble(r->last_read); }
static PyObject *Relay_get_pending(Relay *r, void *c) { return PyLong_FromLong(r->pending); }
static PyObject *Relay_get_fast_reads(Relay *r, void *c) { return PyLong_FromLongLong(r->fast_reads); }

static PyGetSetDef Relay_getset[] = {
    {"ttft", (getter)Relay_get_ttft, NULL, "seconds from t0 to the first token event, or None", NULL},
    {"gaps", (getter)Relay_get_gaps, NULL, "sum of the inter-token gaps", NULL},
    {"max_gap", (getter)Relay_get_max_gap, NULL, "the largest inter-token gap", NULL},
    {"chunks", (getter)Relay_get_chunks, NULL, "token events seen", NULL},
    {"seen_done", (getter)Relay_get_seen_done, NULL, "a fast read ended with [DONE]", NULL},
    {"last_read", (getter)Relay_get_last_read, NULL, "monotonic time of the last fast read (0: none)", NULL},
    {"pending", (getter)Relay_get_pending, NULL, "ITL observations batched, not yet taken", NULL},
    {"fast_reads", (getter)Relay_get_fast_reads, NULL, "reads relayed by feed()", NULL},
    {NULL},
};

static PyMethodDef Relay_methods[] = {
    {"feed", (PyCFunction)Relay_feed, METH_O, "relay one engine read; flags (SLOW: nothing done)"},
    {"tick", (PyCFunction)(void (*)(void))Relay_tick, METH_FASTCALL,
     "tick(events, now=None): `events` token events reached the client (at `now`, monotonic seconds); flags"},
    {"take", (PyCFunction)Relay_take, METH_NOARGS, "(counts per bucket, sum) of batched ITL; resets"},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, "drop the transport and flow references"},
    {NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._splice.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Relay(transport, flow, bounds, t0): the per-read relay of one decode stream",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Relay_init,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_traverse = (traverseproc)Relay_traverse,
    .tp_clear = (inquiry)Relay_clear,
    .tp_methods = Relay_methods,
    .tp_getset = Relay_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._splice", "The decode stream's per-read relay in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__splice(void) {
    PyObject *m;
    if (PyType_Ready(&RelayType) < 0) return NULL;
    s_is_closing = PyUnicode_InternFromString("is_closing");
    s_write = PyUnicode_InternFromString("write");
    s_write_paused = PyUnicode_InternFromString("write_paused");
    if (!s_is_closing || !s_write || !s_write_paused) return NULL;
    m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&RelayType);
    if (PyModule_AddObject(m, "Relay", (PyObject *)&RelayType) < 0) {
        Py_DECREF(&RelayType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "SLOW", R_SLOW) < 0 || PyModule_AddIntConstant(m, "PAUSED", R_PAUSED) < 0 ||
        PyModule_AddIntConstant(m, "FLUSH", R_FLUSH) < 0 || PyModule_AddIntConstant(m, "ITL_FLUSH", ITL_FLUSH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
