/* transport._kvio: the C core of the KV transport (twin: transport/_kvio_py.py).
 *
 * The C does the hot loop and the system calls; Python above holds the logic.
 * Every function takes raw addresses packed in buffers of native uint64
 * ("descriptors": rows of (src_addr, dst_addr, len)), releases the GIL around
 * the copying or blocking work, retries EINTR (checking signals, PEP 475) and
 * raises OSError from errno.  Nothing here knows about peers or protocols.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BATCH 1024 /* IOV_MAX on Linux */

/* A buffer of uint64, viewed flat. */
typedef struct {
    Py_buffer view;
    const uint64_t *p;
    Py_ssize_t n;
} u64buf;

static int u64_get(PyObject *obj, u64buf *b, const char *what, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    if (b->view.len % 8 != 0 || (b->view.itemsize != 1 && b->view.itemsize != 8)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a buffer of uint64", what);
        PyBuffer_Release(&b->view);
        return -1;
    }
    b->p = (const uint64_t *)b->view.buf;
    b->n = b->view.len / 8;
    return 0;
}

static int descs_get(PyObject *obj, u64buf *b) {
    if (u64_get(obj, b, "descriptors", 0) < 0) return -1;
    if (b->n % 3 != 0) {
        PyErr_SetString(PyExc_ValueError, "descriptors: length is not a multiple of 3");
        PyBuffer_Release(&b->view);
        return -1;
    }
    b->n /= 3;
    return 0;
}

/* ---------------------------------------------------------------- layout */

typedef struct { uint64_t s, d, len; } seg_t;

static PyObject *
build_descriptors(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"src_bases", "dst_bases", "src_block_bytes", "dst_block_bytes",
                             "src_ids", "dst_ids", "nbytes", "src_stride", "dst_stride", NULL};
    PyObject *o_sb, *o_db, *o_si, *o_di, *o_sbb, *o_dbb, *o_ss = NULL, *o_ds = NULL;
    unsigned long long sbb, dbb, sstride = 0, dstride = 0;
    long long nbytes = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|LOO", kwlist, &o_sb, &o_db, &o_sbb, &o_dbb,
                                     &o_si, &o_di, &nbytes, &o_ss, &o_ds))
        return NULL;
    /* PyLong_AsUnsignedLongLong raises OverflowError on negatives, like the twin. */
    sbb = PyLong_AsUnsignedLongLong(o_sbb);
    if (sbb == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    dbb = PyLong_AsUnsignedLongLong(o_dbb);
    if (dbb == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (o_ss && (sstride = PyLong_AsUnsignedLongLong(o_ss)) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (o_ds && (dstride = PyLong_AsUnsignedLongLong(o_ds)) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    u64buf sb = {0}, db = {0}, si = {0}, di = {0};
    seg_t *rel = NULL;
    PyObject *out = NULL;
    if (u64_get(o_sb, &sb, "src_bases", 0) < 0) return NULL;
    if (u64_get(o_db, &db, "dst_bases", 0) < 0) goto done;
    if (u64_get(o_si, &si, "src_ids", 0) < 0) goto done;
    if (u64_get(o_di, &di, "dst_ids", 0) < 0) goto done;

    if (sb.n != db.n) {
        PyErr_SetString(PyExc_ValueError, "src_bases and dst_bases differ in length");
        goto done;
    }
    if (sbb == 0 || dbb == 0) {
        PyErr_SetString(PyExc_ValueError, "block bytes must be > 0");
        goto done;
    }
    if (sstride == 0) sstride = sbb;
    if (dstride == 0) dstride = dbb;
    if (sstride < sbb || dstride < dbb) {
        PyErr_SetString(PyExc_ValueError, "stride must be >= block bytes");
        goto done;
    }
    unsigned __int128 savail = (unsigned __int128)si.n * sbb, davail = (unsigned __int128)di.n * dbb;
    unsigned __int128 total = savail < davail ? savail : davail;
    if (nbytes >= 0) {
        if ((unsigned __int128)nbytes > total) {
            PyErr_SetString(PyExc_ValueError, "nbytes exceeds the bytes covered by the block lists");
            goto done;
        }
        total = (unsigned __int128)nbytes;
    }

    /* 1. Offsets relative to a layer's base: walk both block lists together, merge runs. */
    size_t cap = (size_t)si.n + (size_t)di.n + 1, nrel = 0;
    rel = PyMem_Malloc(cap * sizeof(seg_t));
    if (!rel) { PyErr_NoMemory(); goto done; }
    Py_ssize_t i = 0, j = 0;
    uint64_t so = 0, dof = 0;
    uint64_t left = (uint64_t)total;
    while (left) {
        uint64_t n = sbb - so;
        if (dbb - dof < n) n = dbb - dof;
        if (left < n) n = left;
        uint64_t s, d;
        if (__builtin_mul_overflow(si.p[i], sstride, &s) || __builtin_add_overflow(s, so, &s) ||
            __builtin_mul_overflow(di.p[j], dstride, &d) || __builtin_add_overflow(d, dof, &d)) {
            PyErr_SetString(PyExc_OverflowError, "block id * stride overflows 64 bits");
            goto done;
        }
        if (nrel && rel[nrel - 1].s + rel[nrel - 1].len == s && rel[nrel - 1].d + rel[nrel - 1].len == d)
            rel[nrel - 1].len += n;
        else
            rel[nrel++] = (seg_t){s, d, n};
        left -= n;
        so += n; dof += n;
        if (so == sbb) { so = 0; i++; }
        if (dof == dbb) { dof = 0; j++; }
    }

    /* 2. Per layer: add the bases; merge across a layer boundary only where contiguous. */
    size_t rows = nrel * (size_t)sb.n;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(rows * 3 * 8));
    if (!out) goto done;
    uint64_t *o = (uint64_t *)PyByteArray_AS_STRING(out);
    size_t k = 0;
    for (Py_ssize_t l = 0; l < sb.n; l++) {
        uint64_t bs = sb.p[l], bd = db.p[l];
        for (size_t r = 0; r < nrel; r++) {
            uint64_t s, d, e1, e2;
            if (__builtin_add_overflow(bs, rel[r].s, &s) || __builtin_add_overflow(bd, rel[r].d, &d) ||
                __builtin_add_overflow(s, rel[r].len, &e1) || __builtin_add_overflow(d, rel[r].len, &e2)) {
                PyErr_SetString(PyExc_OverflowError, "base + offset overflows 64 bits");
                Py_CLEAR(out);
                goto done;
            }
            if (k && o[3 * k - 3] + o[3 * k - 1] == s && o[3 * k - 2] + o[3 * k - 1] == d) {
                o[3 * k - 1] += rel[r].len;
            } else {
                o[3 * k] = s; o[3 * k + 1] = d; o[3 * k + 2] = rel[r].len;
                k++;
            }
        }
    }
    if (PyByteArray_Resize(out, (Py_ssize_t)(k * 3 * 8)) < 0) Py_CLEAR(out);
done:
    PyMem_Free(rel);
    if (sb.view.obj) PyBuffer_Release(&sb.view);
    if (db.view.obj) PyBuffer_Release(&db.view);
    if (si.view.obj) PyBuffer_Release(&si.view);
    if (di.view.obj) PyBuffer_Release(&di.view);
    return out;
}

/* ----------------------------------------------------------- local copies */

static PyObject *copy_batch(PyObject *self, PyObject *arg) {
    u64buf b;
    if (descs_get(arg, &b) < 0) return NULL;
    unsigned long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < b.n; r++) {
        const uint64_t *row = b.p + 3 * r;
        memmove((void *)(uintptr_t)row[1], (const void *)(uintptr_t)row[0], (size_t)row[2]);
        total += row[2];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b.view);
    return PyLong_FromUnsignedLongLong(total);
}

/* --------------------------------------------- iovec cursor over descriptors */

typedef struct { const uint64_t *p; Py_ssize_t n, row; uint64_t off; } cursor_t;

/* Fill up to BATCH iovecs from column `col` (0 = src, 1 = dst); returns count. */
static int cursor_fill(const cursor_t *c, int col, struct iovec *iov) {
    int k = 0;
    uint64_t off = c->off;
    for (Py_ssize_t r = c->row; r < c->n && k < BATCH; r++, off = 0) {
        const uint64_t *row = c->p + 3 * r;
        if (row[2] == off) continue;
        iov[k].iov_base = (void *)(uintptr_t)(row[col] + off);
        iov[k].iov_len = (size_t)(row[2] - off);
        k++;
    }
    return k;
}

static void cursor_advance(cursor_t *c, uint64_t n) {
    while (c->row < c->n) {
        uint64_t rest = c->p[3 * c->row + 2] - c->off;
        if (n < rest) { c->off += n; return; }
        n -= rest; c->row++; c->off = 0;
    }
}

/* ----------------------------------------------- process_vm_writev / readv */

/* process_vm_writev/readv take separate iovec lists for the two sides, cut independently: fill
 * both from the cursor, merging runs that are contiguous on one side even where they are not on
 * the other (rows sorted by destination make the remote list a few long runs, so the kernel pins
 * the peer's pages up to 1,024 at a time instead of one descriptor at a time). Stops at the first
 * row that would need a new iovec on a side that already has BATCH. */
static void fill_pair(const cursor_t *c, int lcol, int rcol, struct iovec *loc, int *kl,
                      struct iovec *rem, int *kr) {
    int a = 0, b = 0;
    uint64_t off = c->off;
    for (Py_ssize_t r = c->row; r < c->n; r++, off = 0) {
        const uint64_t *row = c->p + 3 * r;
        if (row[2] == off) continue;
        uint64_t l = row[lcol] + off, m = row[rcol] + off, len = row[2] - off;
        int lm = a && (uint64_t)(uintptr_t)loc[a - 1].iov_base + loc[a - 1].iov_len == l;
        int rm = b && (uint64_t)(uintptr_t)rem[b - 1].iov_base + rem[b - 1].iov_len == m;
        if ((!lm && a == BATCH) || (!rm && b == BATCH)) break;
        if (lm) loc[a - 1].iov_len += (size_t)len;
        else { loc[a].iov_base = (void *)(uintptr_t)l; loc[a].iov_len = (size_t)len; a++; }
        if (rm) rem[b - 1].iov_len += (size_t)len;
        else { rem[b].iov_base = (void *)(uintptr_t)m; rem[b].iov_len = (size_t)len; b++; }
    }
    *kl = a; *kr = b;
}

static PyObject *vm_copy(PyObject *args, int write) {
    int pid;
    PyObject *o;
    if (!PyArg_ParseTuple(args, "iO", &pid, &o)) return NULL;
    u64buf b;
    if (descs_get(o, &b) < 0) return NULL;
    cursor_t c = {b.p, b.n, 0, 0};
    struct iovec *loc = PyMem_Malloc(2 * BATCH * sizeof(struct iovec));
    if (!loc) { PyBuffer_Release(&b.view); return PyErr_NoMemory(); }
    struct iovec *rem = loc + BATCH;
    unsigned long long total = 0;
    int err = 0;
    /* write: local = src (col 0), remote = dst (col 1); read: local = dst, remote = src. */
    int lcol = write ? 0 : 1, rcol = write ? 1 : 0;
    for (;;) {
        int kl, kr;
        fill_pair(&c, lcol, rcol, loc, &kl, rem, &kr);
        if (kl == 0) break;
        ssize_t n;
        Py_BEGIN_ALLOW_THREADS
        n = write ? process_vm_writev(pid, loc, kl, rem, kr, 0) : process_vm_readv(pid, loc, kl, rem, kr, 0);
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (errno == EINTR) { if (PyErr_CheckSignals() < 0) { err = -1; break; } continue; }
            err = errno; break;
        }
        if (n == 0) { err = EFAULT; break; }
        total += (unsigned long long)n;
        cursor_advance(&c, (uint64_t)n);
    }
    PyMem_Free(loc);
    PyBuffer_Release(&b.view);
    if (err == -1) return NULL;
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *vm_write(PyObject *self, PyObject *args) { return vm_copy(args, 1); }
static PyObject *vm_read(PyObject *self, PyObject *args) { return vm_copy(args, 0); }

/* ------------------------------------------------- socket gather / scatter */

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* send: gather column `col` into the socket; recv: scatter from it.
 * timeout_ms < 0 waits forever; on the deadline raise TimeoutError.
 * recv returns early (fewer bytes) on EOF; send raises (EPIPE, ECONNRESET). */
static PyObject *sock_iov(PyObject *args, int sending) {
    int fd, col;
    long long timeout_ms;
    PyObject *o;
    if (!PyArg_ParseTuple(args, "iOiL", &fd, &o, &col, &timeout_ms)) return NULL;
    if (col != 0 && col != 1) { PyErr_SetString(PyExc_ValueError, "col must be 0 or 1"); return NULL; }
    u64buf b;
    if (descs_get(o, &b) < 0) return NULL;
    cursor_t c = {b.p, b.n, 0, 0};
    struct iovec *iov = PyMem_Malloc(BATCH * sizeof(struct iovec));
    if (!iov) { PyBuffer_Release(&b.view); return PyErr_NoMemory(); }
    long long deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    unsigned long long total = 0;
    int err = 0;
    for (;;) {
        int k = cursor_fill(&c, col, iov);
        if (k == 0) break;
        ssize_t n;
        int saved;
        Py_BEGIN_ALLOW_THREADS
        if (sending) {
            struct msghdr m = {0};
            m.msg_iov = iov; m.msg_iovlen = (size_t)k;
            n = sendmsg(fd, &m, MSG_NOSIGNAL);
        } else {
            n = readv(fd, iov, k);
        }
        saved = errno;
        if (n < 0 && (saved == EAGAIN || saved == EWOULDBLOCK)) {
            /* Non-blocking socket (Python's settimeout): wait for readiness. */
            struct pollfd p = {fd, sending ? POLLOUT : POLLIN, 0};
            long long wait = deadline < 0 ? -1 : deadline - now_ms();
            int r = 0;
            if (deadline < 0 || wait > 0)
                r = poll(&p, 1, deadline < 0 ? -1 : (wait > INT_MAX ? INT_MAX : (int)wait));
            saved = r == 0 ? ETIMEDOUT : (r < 0 ? errno : EAGAIN);
        }
        Py_END_ALLOW_THREADS
        if (n < 0) {
            if (saved == EAGAIN) continue;
            if (saved == EINTR) { if (PyErr_CheckSignals() < 0) { err = -1; break; } continue; }
            err = saved; break;
        }
        if (n == 0 && !sending) break; /* EOF */
        total += (unsigned long long)n;
        cursor_advance(&c, (uint64_t)n);
        if (deadline >= 0 && c.row < c.n && now_ms() > deadline) { err = ETIMEDOUT; break; }
    }
    PyMem_Free(iov);
    PyBuffer_Release(&b.view);
    if (err == -1) return NULL;
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *send_iov(PyObject *self, PyObject *args) { return sock_iov(args, 1); }
static PyObject *recv_iov(PyObject *self, PyObject *args) { return sock_iov(args, 0); }

static PyMethodDef methods[] = {
    {"build_descriptors", (PyCFunction)(void (*)(void))build_descriptors, METH_VARARGS | METH_KEYWORDS,
     "build_descriptors(src_bases, dst_bases, src_block_bytes, dst_block_bytes, src_ids, dst_ids,"
     " nbytes=-1, src_stride=0, dst_stride=0) -> bytearray of uint64 rows (src, dst, len)"},
    {"copy_batch", copy_batch, METH_O, "copy_batch(descs) -> bytes copied (memmove per row)"},
    {"vm_write", vm_write, METH_VARARGS, "vm_write(pid, descs) -> bytes (process_vm_writev)"},
    {"vm_read", vm_read, METH_VARARGS, "vm_read(pid, descs) -> bytes (process_vm_readv)"},
    {"send_iov", send_iov, METH_VARARGS, "send_iov(fd, descs, col, timeout_ms) -> bytes sent"},
    {"recv_iov", recv_iov, METH_VARARGS, "recv_iov(fd, descs, col, timeout_ms) -> bytes read (short on EOF)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kvio", "KV transport C core.", 0, methods};

PyMODINIT_FUNC PyInit__kvio(void) { return PyModuleDef_Init(&moduledef); }
