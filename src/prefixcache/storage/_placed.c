/* A disk frame read, checksummed and placed in one call that leaves the GIL.
 *
 * A load from the disk tier reads a file per block, hashes its payload and copies the
 * payload's rows into their place in the load's array. In Python each of those is its
 * own call that drops and retakes the GIL, and the threads of a load queue on it: two
 * threads ran slower than one. Here the whole block is one call: open, read into the
 * caller's buffer, XXH3-128 of the payload (the codec's payload checksum, same library),
 * scatter of the rows, close. Nothing is verified here: the caller compares the checksum
 * and parses the header (storage/placed.py, codec.py) before it trusts the placed bytes.
 *
 *   read_placed(path: bytes, buffer: writable, out: writable, offset, rows, src_row,
 *               copy_row, stride) -> (length: int, checksum: bytes | None)
 *
 * The payload is the file's last rows * src_row bytes; row r's first copy_row bytes go
 * to out[offset + r * stride]. checksum is None (and nothing is placed) when the file is
 * shorter than the payload or longer than buffer; length is then the file's size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

static int read_all(int fd, char *buf, Py_ssize_t n) {
    Py_ssize_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, (size_t)(n - got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return EIO; /* shorter than fstat said: truncated under us */
        got += r;
    }
    return 0;
}

static PyObject *read_placed(PyObject *self, PyObject *args) {
    PyObject *path;
    Py_buffer buffer, out;
    Py_ssize_t offset, rows, src_row, copy_row, stride;
    if (!PyArg_ParseTuple(args, "O&w*w*nnnnn", PyUnicode_FSConverter, &path, &buffer, &out, &offset, &rows,
                          &src_row, &copy_row, &stride))
        return NULL;
    PyObject *result = NULL;
    if (rows < 1 || src_row < 1 || copy_row < 0 || copy_row > src_row || offset < 0 || stride < copy_row ||
        rows > PY_SSIZE_T_MAX / src_row || (rows - 1) > (PY_SSIZE_T_MAX - offset - copy_row) / (stride ? stride : 1) ||
        offset + (rows - 1) * stride + copy_row > out.len) {
        PyErr_SetString(PyExc_ValueError, "read_placed: the rows do not fit the output buffer");
        goto done;
    }
    Py_ssize_t payload = rows * src_row, size = 0;
    int err = 0, placed = 0;
    unsigned char digest[16];
    const char *name = PyBytes_AS_STRING(path);
    Py_BEGIN_ALLOW_THREADS
    /* no link followed, no open that waits (a FIFO), only a regular file read: a name in a
       shared folder costs a miss, never a hang or an endless read (disk.py's read_file) */
    int fd = open(name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    struct stat st;
    if (fd < 0) {
        err = errno;
    } else {
        if (fstat(fd, &st) != 0) {
            err = errno;
        } else if (!S_ISREG(st.st_mode)) {
            err = EINVAL;
        } else {
            size = (Py_ssize_t)st.st_size;
            if (size >= payload && size <= buffer.len && (err = read_all(fd, buffer.buf, size)) == 0) {
                const char *src = (const char *)buffer.buf + (size - payload);
                XXH128_canonical_t c;
                XXH128_canonicalFromHash(&c, XXH3_128bits(src, (size_t)payload));
                memcpy(digest, c.digest, 16);
                char *dst = (char *)out.buf + offset;
                for (Py_ssize_t r = 0; r < rows; r++) memcpy(dst + r * stride, src + r * src_row, (size_t)copy_row);
                placed = 1;
            }
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        goto done;
    }
    if (placed)
        result = Py_BuildValue("(ny#)", size, (const char *)digest, (Py_ssize_t)16);
    else
        result = Py_BuildValue("(nO)", size, Py_None);
done:
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&out);
    Py_DECREF(path);
    return result;
}

static PyMethodDef methods[] = {
    {"read_placed", read_placed, METH_VARARGS, "Read a frame file, hash its payload, place its rows (no GIL)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef placed_module = {PyModuleDef_HEAD_INIT, "_placed", NULL, -1, methods};

PyMODINIT_FUNC PyInit__placed(void) { return PyModule_Create(&placed_module); }
