/* A stager's small file-system calls with the GIL held: open, close, rename, the mtime, an append, a small pwrite.
 *
 * Python's os module gives the GIL back around every system call. With 32 fetching threads on a few cores, each
 * of those is a hand-over: futex calls and, as often as not, a context switch, which cost more than the call
 * itself when the call is a rename or a stat of a file the page cache holds (a few microseconds). Small objects
 * made ten such calls each (docs/staging.md of 14aa98a (in git), "Small objects over https"); these five are made here without the
 * hand-over, and so is a small object's body's write (httpget.get_into, up to heldio.HELD_WRITE bytes: a copy
 * into the page cache of tens of microseconds). Only for calls on the stager's local destination, which do not
 * wait on a device: a stat or rename on a network file system that hangs would hold every thread with it.
 * A larger body's buffer goes the other way (pwrite_pieces): the GIL released once for all of it, written in
 * pieces whose size the page cache sizes its folios by (heldio.WRITE_PIECE).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

/* A path argument: its file-system form (str or bytes, what an error names, as the os module's errors do) and
 * the bytes the system call takes. 0 with an exception set where it is not a path. */
typedef struct {
    PyObject *named;
    PyObject *bytes;
} path_t;

static int path_of(PyObject *arg, path_t *p) {
    p->named = PyOS_FSPath(arg);
    p->bytes = NULL;
    if (p->named == NULL)
        return 0;
    if (!PyUnicode_FSConverter(p->named, &p->bytes)) {
        Py_CLEAR(p->named);
        return 0;
    }
    return 1;
}

static void path_done(path_t *p) {
    Py_CLEAR(p->named);
    Py_CLEAR(p->bytes);
}

static PyObject *error_for(path_t *p) {
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, p->named);
}

/* open(path, flags, mode) -> fd */
static PyObject *h_open(PyObject *self, PyObject *args) {
    PyObject *arg;
    int flags, mode;
    path_t path;
    if (!PyArg_ParseTuple(args, "Oii", &arg, &flags, &mode) || !path_of(arg, &path))
        return NULL;
    int fd;
    do {
        fd = open(PyBytes_AS_STRING(path.bytes), flags | O_CLOEXEC, mode);
    } while (fd < 0 && errno == EINTR);
    PyObject *r = fd < 0 ? error_for(&path) : PyLong_FromLong(fd);
    path_done(&path);
    return r;
}

/* close(fd) */
static PyObject *h_close(PyObject *self, PyObject *arg) {
    int fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (close(fd) < 0 && errno != EINTR)  /* EINTR: the descriptor is gone all the same (Linux) */
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* replace(src, dst): rename, over dst if it is there */
static PyObject *h_replace(PyObject *self, PyObject *args) {
    PyObject *a, *b;
    path_t src, dst;
    if (!PyArg_ParseTuple(args, "OO", &a, &b) || !path_of(a, &src))
        return NULL;
    if (!path_of(b, &dst)) {
        path_done(&src);
        return NULL;
    }
    PyObject *r = NULL;
    if (rename(PyBytes_AS_STRING(src.bytes), PyBytes_AS_STRING(dst.bytes)) < 0)
        PyErr_SetFromErrnoWithFilenameObjects(PyExc_OSError, src.named, dst.named);
    else
        r = Py_NewRef(Py_None);
    path_done(&src);
    path_done(&dst);
    return r;
}

/* mtime_ns(path) -> st_mtime in nanoseconds, as os.stat(path).st_mtime_ns */
static PyObject *h_mtime_ns(PyObject *self, PyObject *arg) {
    path_t path;
    if (!path_of(arg, &path))
        return NULL;
    struct stat st;
    PyObject *r;
    if (stat(PyBytes_AS_STRING(path.bytes), &st) < 0)
        r = error_for(&path);
    else
        r = PyLong_FromLongLong((long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
    path_done(&path);
    return r;
}

/* All of ``b``: at ``pos`` (pwrite), or where the file is (write) when ``pos`` is negative; in calls of at most
 * ``piece`` bytes (0: as much as the call takes), the GIL released around all of it where ``release``. */
static PyObject *put_all(int fd, Py_buffer *b, long long pos, Py_ssize_t piece, int release) {
    const char *p = b->buf;
    Py_ssize_t left = b->len;
    int err = 0;
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    while (left > 0) {
        size_t n = (size_t)(piece > 0 && left > piece ? piece : left);
        ssize_t k = pos < 0 ? write(fd, p, n) : pwrite(fd, p, n, (off_t)pos);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        if (k == 0) { /* a regular file takes something or says why; never spin on nothing */
            err = EIO;
            break;
        }
        p += k;
        left -= k;
        if (pos >= 0)
            pos += k;
    }
    if (saved)
        PyEval_RestoreThread(saved);
    PyBuffer_Release(b);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* write(fd, data): all of it (a file opened with O_APPEND: one line of a journal) */
static PyObject *h_write(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "iy*", &fd, &b))
        return NULL;
    return put_all(fd, &b, -1, 0, 0);
}

/* pwrite(fd, data, pos): all of it at ``pos`` (a small object's body, httpget.get_into) */
static PyObject *h_pwrite(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer b;
    long long pos;
    if (!PyArg_ParseTuple(args, "iy*L", &fd, &b, &pos))
        return NULL;
    if (pos < 0) {
        PyBuffer_Release(&b);
        errno = EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return put_all(fd, &b, pos, 0, 0);
}

/* pwrite_pieces(fd, data, pos, piece): all of ``data`` at ``pos``, the GIL released once around the whole of it,
 * in pwrite calls of at most ``piece`` bytes (heldio.WRITE_PIECE: the page cache's folio for each call is sized by
 * the call, docs/staging.md "Large page-cache writes on this VM") */
static PyObject *h_pwrite_pieces(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer b;
    long long pos;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "iy*Ln", &fd, &b, &pos, &piece))
        return NULL;
    if (pos < 0 || piece <= 0) {
        PyBuffer_Release(&b);
        errno = EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return put_all(fd, &b, pos, piece, 1);
}

static PyMethodDef methods[] = {
    {"open", h_open, METH_VARARGS, "open(path, flags, mode) -> fd, the GIL held"},
    {"close", h_close, METH_O, "close(fd), the GIL held"},
    {"replace", h_replace, METH_VARARGS, "replace(src, dst): rename, the GIL held"},
    {"mtime_ns", h_mtime_ns, METH_O, "mtime_ns(path) -> os.stat(path).st_mtime_ns, the GIL held"},
    {"write", h_write, METH_VARARGS, "write(fd, data): all of data, the GIL held"},
    {"pwrite", h_pwrite, METH_VARARGS, "pwrite(fd, data, pos): all of data at pos, the GIL held"},
    {"pwrite_pieces", h_pwrite_pieces, METH_VARARGS,
     "pwrite_pieces(fd, data, pos, piece): all of data at pos in writes of at most piece bytes, the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_heldio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__heldio(void) { return PyModule_Create(&module); }
