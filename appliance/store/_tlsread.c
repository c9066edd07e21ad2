/* An https body read many TLS records at a time with the GIL released (appliance/store/httpget.py).
 *
 * Python's ssl module reads one TLS record (at most 16 KiB) per call, and each call releases and takes back the
 * GIL: 131,072 calls for 2 GiB. With the stager's threads on few cores every one of them is a hand-over of the GIL
 * between threads (a futex wake, a context switch). recv_into() here loops SSL_read_ex() over the records of one
 * buffer (512 KiB: 32 records) with the GIL released once; what OpenSSL does with each record is unchanged.
 * The same approach as SABnzbd's sabctools (its unlocked_ssl_recv_into); written for this package.
 *
 * The SSL* is the one Python's ssl module made: an ssl.SSLSocket's ``_sslobj`` is a ``_ssl._SSLSocket``, whose C
 * struct starts with PyObject_HEAD, a weakref to the socket and the SSL* (python/cpython Modules/_ssl.c,
 * ``PySSLSocket``, the same from 3.7 to 3.14). The OpenSSL functions are those of the library Python's _ssl module
 * loaded (dlopen of its file with RTLD_NOLOAD, then dlsym), never another copy of OpenSSL. Each call checks that the
 * object is a _ssl._SSLSocket and that SSL_get_fd() of its SSL* is the socket's descriptor the caller gives;
 * available() is false where any of this cannot be had (httpget then reads through the ssl module, as before).
 *
 * recv_into(sslobj, fd, buffer, timeout_ms): fills ``buffer`` (a writable bytes-like object) from the TLS connection
 * and returns the bytes read, fewer only at the end of the stream (0: it had ended). The socket may be non-blocking
 * (Python's sockets with a timeout are): a record not yet there is waited for with poll(), up to timeout_ms
 * (negative: no limit) without any byte coming, then TimeoutError; a signal meanwhile returns what came, or runs its
 * Python handler and waits on. A TLS error raises ConnectionError with OpenSSL's error code; the thread's OpenSSL
 * error queue is left empty.
 * recv_some(sslobj, fd, buffer, timeout_ms): the same, but returns once something has come and nothing more is
 * there without waiting (a socket's recv_into: what http.client's reader asks for an answer's headers).
 * send_all(sslobj, fd, data, timeout_ms): writes all of ``data`` (waiting for room as recv_into waits for bytes).
 * set_ciphersuites(context, suites): SSL_CTX_set_ciphersuites() on an ssl.SSLContext (a _ssl._SSLContext, whose C
 * struct starts with PyObject_HEAD and the SSL_CTX*: ``PySSLContext``, the same from 3.7 to 3.14). Python has no
 * setter for TLS 1.3's suites (set_ciphers() is TLS 1.2's), and OpenSSL offers AES-256-GCM first; httpget offers
 * AES-128-GCM first, as Go's crypto/tls client (s5cmd, rclone) and Mozilla's recommended server order do.
 * The ssl module releases the GIL for each record and again for each poll(): an answer's headers were a read that
 * found nothing, a poll and a read; a request a poll and a write. Each is one release here.
 * read_ahead(context, length): SSL_CTX_set_read_ahead() and SSL_CTX_set_default_read_buffer_len() on an
 * ssl.SSLContext, for the connections made from it afterwards. Without read-ahead OpenSSL reads a record with two
 * read()s, its 5-byte header and then its body (ssl/record/rec_layer_s3.c, ssl3_read_n(): ``max = n`` unless
 * read_ahead): 262,000 system calls for 2 GiB. With it, each read() takes what the socket holds, up to ``length``
 * (never less than one record's buffer); the records are then taken from that buffer as before. A wait for bytes
 * is still right: OpenSSL asks for the socket (WANT_READ) only once the buffered bytes hold no whole record.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <string.h>

#define SSL_ERROR_SSL 1
#define SSL_ERROR_WANT_READ 2
#define SSL_ERROR_WANT_WRITE 3
#define SSL_ERROR_SYSCALL 5
#define SSL_ERROR_ZERO_RETURN 6

typedef struct {
    PyObject_HEAD
    PyObject *Socket; /* weakref to the socket (Python's own use) */
    void *ssl;        /* SSL* */
} SSLSocketHead;

static int (*p_SSL_read_ex)(void *, void *, size_t, size_t *);
static int (*p_SSL_write_ex)(void *, const void *, size_t, size_t *);
static int (*p_SSL_get_error)(const void *, int);
static int (*p_SSL_get_fd)(const void *);
static void (*p_ERR_clear_error)(void);
static int (*p_SSL_CTX_set_ciphersuites)(void *, const char *);
static long (*p_SSL_CTX_ctrl)(void *, int, long, void *);
static void (*p_SSL_CTX_set_default_read_buffer_len)(void *, size_t);

static int linked(void) {
    return p_SSL_read_ex && p_SSL_write_ex && p_SSL_get_error && p_SSL_get_fd && p_ERR_clear_error;
}

static void link_openssl(void) {
    PyObject *mod = PyImport_ImportModule("_ssl");
    if (!mod) { PyErr_Clear(); return; }
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (!file) { PyErr_Clear(); return; } /* _ssl built into the interpreter: its OpenSSL is not a library here */
    const char *path = PyUnicode_AsUTF8(file);
    void *h = path ? dlopen(path, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    Py_DECREF(file);
    PyErr_Clear();
    if (!h) return;
    /* dlsym on the module's handle searches it and the libraries it was linked with: its libssl and libcrypto */
    *(void **)&p_SSL_read_ex = dlsym(h, "SSL_read_ex");
    *(void **)&p_SSL_write_ex = dlsym(h, "SSL_write_ex");
    *(void **)&p_SSL_get_error = dlsym(h, "SSL_get_error");
    *(void **)&p_SSL_get_fd = dlsym(h, "SSL_get_fd");
    *(void **)&p_ERR_clear_error = dlsym(h, "ERR_clear_error");
    *(void **)&p_SSL_CTX_set_ciphersuites = dlsym(h, "SSL_CTX_set_ciphersuites"); /* OpenSSL >= 1.1.1 */
    *(void **)&p_SSL_CTX_ctrl = dlsym(h, "SSL_CTX_ctrl");
    *(void **)&p_SSL_CTX_set_default_read_buffer_len = dlsym(h, "SSL_CTX_set_default_read_buffer_len"); /* >= 1.1.0 */
    if (!linked()) p_SSL_read_ex = NULL;
}

static int is_sslobj(PyObject *o) { return strcmp(Py_TYPE(o)->tp_name, "_ssl._SSLSocket") == 0; }

static PyObject *available(PyObject *self, PyObject *noargs) { return PyBool_FromLong(linked()); }

enum { FILL, SOME, WRITE };

/* The SSL* of ``obj`` when it is a _ssl._SSLSocket on descriptor ``fd``, else NULL with an exception set. */
static void *ssl_of(PyObject *obj, int fd, const char *fn) {
    if (!linked() || !is_sslobj(obj)) {
        PyErr_Format(PyExc_TypeError, "%s() takes an ssl.SSLSocket's _sslobj (and OpenSSL linked)", fn);
        return NULL;
    }
    void *ssl = ((SSLSocketHead *)obj)->ssl;
    if (!ssl || p_SSL_get_fd(ssl) != fd) {
        PyErr_Format(PyExc_ValueError, "%s(): the TLS object is not on that socket", fn);
        return NULL;
    }
    return ssl;
}

/* FILL: read until ``buf`` is full or the stream ends. SOME: wait for a first byte, then take what has come
 * without waiting again. WRITE: send all of ``buf``. The GIL is released once for the whole of it. */
static PyObject *transfer(void *ssl, int fd, Py_buffer *buf, int timeout_ms, int mode) {
    char *mem = buf->buf;
    size_t want = (size_t)buf->len, got = 0;
    int err, timed_out, interrupted, sys_errno;
    for (;;) {
        err = timed_out = interrupted = sys_errno = 0;
        Py_BEGIN_ALLOW_THREADS
        while (got < want) {
            size_t n = 0;
            int ok = mode == WRITE ? p_SSL_write_ex(ssl, mem + got, want - got, &n)
                                   : p_SSL_read_ex(ssl, mem + got, want - got, &n);
            if (ok) {
                got += n;
                continue;
            }
            err = p_SSL_get_error(ssl, 0);
            if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
                if (mode == SOME && got) { err = 0; break; } /* what had come is returned; no second wait */
                struct pollfd p = {fd, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, 0};
                int r = poll(&p, 1, timeout_ms);
                if (r == 0) { timed_out = 1; break; }
                if (r < 0) {
                    if (errno == EINTR) { interrupted = 1; err = 0; break; }
                    sys_errno = errno;
                    err = SSL_ERROR_SYSCALL;
                    break;
                }
                err = 0;
                continue;
            }
            if (err == SSL_ERROR_ZERO_RETURN && mode != WRITE) err = 0; /* the peer closed the TLS stream */
            else sys_errno = errno;
            break;
        }
        if (err) p_ERR_clear_error();
        Py_END_ALLOW_THREADS
        /* a signal while waiting: its Python handler runs now (a TERM's exit, a ^C), then the wait goes on */
        if (!interrupted || (got && mode != WRITE)) break;
        if (PyErr_CheckSignals() < 0) return NULL;
    }
    if (timed_out) {
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        return NULL;
    }
    if (err) {
        if (err == SSL_ERROR_SYSCALL && sys_errno) {
            errno = sys_errno;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        /* EOF without close_notify after some bytes: the caller counts them */
        if (err == SSL_ERROR_SYSCALL && got && mode != WRITE) return PyLong_FromSize_t(got);
        PyErr_Format(PyExc_ConnectionError, "TLS %s failed (OpenSSL error %d)", mode == WRITE ? "write" : "read",
                     err);
        return NULL;
    }
    return PyLong_FromSize_t(got);
}

static PyObject *call(PyObject *args, const char *parse, int mode, const char *fn) {
    PyObject *obj;
    int fd, timeout_ms;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, parse, &obj, &fd, &buf, &timeout_ms)) return NULL;
    void *ssl = ssl_of(obj, fd, fn);
    PyObject *r = ssl ? transfer(ssl, fd, &buf, timeout_ms, mode) : NULL;
    PyBuffer_Release(&buf);
    return r;
}

typedef struct {
    PyObject_HEAD
    void *ctx; /* SSL_CTX* */
} SSLContextHead;

/* ssl.SSLContext is a Python subclass of _ssl._SSLContext: its C struct is the base's, fields appended after */
static int is_sslcontext(PyObject *o) {
    for (PyTypeObject *t = Py_TYPE(o); t; t = t->tp_base)
        if (strcmp(t->tp_name, "_ssl._SSLContext") == 0) return 1;
    return 0;
}

static PyObject *set_ciphersuites(PyObject *self, PyObject *args) {
    PyObject *obj;
    const char *suites;
    if (!PyArg_ParseTuple(args, "Os", &obj, &suites)) return NULL;
    if (!linked() || !p_SSL_CTX_set_ciphersuites || !is_sslcontext(obj)) {
        PyErr_SetString(PyExc_TypeError, "set_ciphersuites() takes an ssl.SSLContext (and OpenSSL >= 1.1.1 linked)");
        return NULL;
    }
    void *ctx = ((SSLContextHead *)obj)->ctx;
    if (!ctx || !p_SSL_CTX_set_ciphersuites(ctx, suites)) {
        p_ERR_clear_error();
        PyErr_Format(PyExc_ValueError, "set_ciphersuites(): OpenSSL took none of %s", suites);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define SSL_CTRL_SET_READ_AHEAD 41

static PyObject *read_ahead(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "On", &obj, &len)) return NULL;
    if (!linked() || !p_SSL_CTX_ctrl || !p_SSL_CTX_set_default_read_buffer_len || !is_sslcontext(obj) || len < 0) {
        PyErr_SetString(PyExc_TypeError, "read_ahead() takes an ssl.SSLContext and a length (and OpenSSL >= 1.1.0)");
        return NULL;
    }
    void *ctx = ((SSLContextHead *)obj)->ctx;
    if (!ctx) {
        PyErr_SetString(PyExc_ValueError, "read_ahead(): the context has no SSL_CTX");
        return NULL;
    }
    p_SSL_CTX_ctrl(ctx, SSL_CTRL_SET_READ_AHEAD, 1, NULL);
    p_SSL_CTX_set_default_read_buffer_len(ctx, (size_t)len);
    Py_RETURN_NONE;
}

static PyObject *recv_into(PyObject *self, PyObject *args) { return call(args, "Oiw*i", FILL, "recv_into"); }
static PyObject *recv_some(PyObject *self, PyObject *args) { return call(args, "Oiw*i", SOME, "recv_some"); }
static PyObject *send_all(PyObject *self, PyObject *args) { return call(args, "Oiy*i", WRITE, "send_all"); }

static PyMethodDef methods[] = {
    {"recv_into", recv_into, METH_VARARGS, "recv_into(sslobj, fd, buffer, timeout_ms) -> bytes read (a full buffer)"},
    {"recv_some", recv_some, METH_VARARGS, "recv_some(sslobj, fd, buffer, timeout_ms) -> bytes read (what has come)"},
    {"send_all", send_all, METH_VARARGS, "send_all(sslobj, fd, data, timeout_ms) -> bytes sent (all of them)"},
    {"set_ciphersuites", set_ciphersuites, METH_VARARGS,
     "set_ciphersuites(context, 'A:B:C'): the TLS 1.3 cipher suites an ssl.SSLContext offers, in its order"},
    {"read_ahead", read_ahead, METH_VARARGS,
     "read_ahead(context, length): the context's connections read up to length bytes from their socket per read"},
    {"available", available, METH_NOARGS, "whether Python's OpenSSL was found"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tlsread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tlsread(void) {
    link_openssl();
    return PyModule_Create(&module);
}
