/* mlfabric.scheduler.core._plan_native: Timelines.transfer and LinkTimeline.reserve (see _plan_native.c). */
#include "_plan_native.h"

/* ------------------------------------------------------------------ LinkTimeline.reserve */

static int list_set_float(PyObject *list, Py_ssize_t i, double v) {
    PyObject *o = PyFloat_FromDouble(v);
    if (o == NULL) return -1;
    return PyList_SetItem(list, i, o); /* steals o */
}

static int list_append_obj(PyObject *list, PyObject *o) { return PyList_Append(list, o); }

static int list_del(PyObject *list, Py_ssize_t i) { return PyList_SetSlice(list, i, i + 1, NULL); }

#define F(list, i) PyFloat_AS_DOUBLE(PyList_GET_ITEM((list), (i)))

int all_floats(PyObject *list) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyFloat_CheckExact(PyList_GET_ITEM(list, i))) return 0;
    return 1;
}

/* bisect_right(times, x, lo) */
static Py_ssize_t bisect_right(PyObject *times, double x, Py_ssize_t lo) {
    Py_ssize_t hi = PyList_GET_SIZE(times);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < F(times, mid))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static int over_error(PyObject *who, double rate, double t, double r) {
    PyObject *msg = PyObject_CallMethod(fmt_over, "format", "dOdd", rate, who, t, r);
    if (msg != NULL) {
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return -1;
}

/* LinkTimeline.reserve on its lists; start/end as objects (stored as given). 0 or -1. */
static int reserve_lists(PyObject *times, PyObject *residual, double eps, PyObject *start_o, PyObject *end_o,
                         double rate, PyObject *who) {
    double start = PyFloat_AS_DOUBLE(start_o), end = PyFloat_AS_DOUBLE(end_o);
    if (end <= start || rate <= 0) return 0;
    Py_ssize_t last = PyList_GET_SIZE(times) - 1;
    double c = F(residual, last);
    double left = c - rate;
    double tl = F(times, last);
    if (start >= tl && left >= -eps) {
        left = left < 0.0 ? 0.0 : left;
        if (start != tl) {
            if (fabs(c - left) > eps) {
                PyObject *c_o = PyList_GET_ITEM(residual, last);
                if (list_append_obj(times, start_o) < 0 || list_append_obj(times, end_o) < 0) return -1;
                PyObject *l_o = PyFloat_FromDouble(left);
                if (l_o == NULL) return -1;
                int rc = PyList_Append(residual, l_o);
                Py_DECREF(l_o);
                if (rc < 0 || PyList_Append(residual, c_o) < 0) return -1;
            }
            return 0;
        }
        PyObject *c_o = PyList_GET_ITEM(residual, last);
        Py_INCREF(c_o);
        if (list_set_float(residual, last, left) < 0) {
            Py_DECREF(c_o);
            return -1;
        }
        if (fabs(c - left) > eps) {
            if (list_append_obj(times, end_o) < 0 || list_append_obj(residual, c_o) < 0) {
                Py_DECREF(c_o);
                return -1;
            }
        }
        Py_DECREF(c_o);
        if (last > 0 && fabs(left - F(residual, last - 1)) <= eps) {
            if (list_del(times, last) < 0 || list_del(residual, last) < 0) return -1;
        }
        return 0;
    }
    Py_ssize_t i = bisect_right(times, start, 0) - 1;
    if (i < 0) {
        PyObject *r0 = PyList_GET_ITEM(residual, 0);
        if (PyList_Insert(times, 0, start_o) < 0 || PyList_Insert(residual, 0, r0) < 0) return -1;
        i = 0;
    } else if (F(times, i) != start) {
        i += 1;
        PyObject *prev = PyList_GET_ITEM(residual, i - 1);
        if (PyList_Insert(times, i, start_o) < 0 || PyList_Insert(residual, i, prev) < 0) return -1;
    }
    Py_ssize_t j = bisect_right(times, end, i) - 1;
    if (F(times, j) != end) {
        j += 1;
        PyObject *prev = PyList_GET_ITEM(residual, j - 1);
        if (PyList_Insert(times, j, end_o) < 0 || PyList_Insert(residual, j, prev) < 0) return -1;
    }
    for (Py_ssize_t k = i; k < j; k++) {
        double r = F(residual, k);
        double lft = r - rate;
        if (lft < -eps) return over_error(who, rate, F(times, k), r);
        if (list_set_float(residual, k, lft < 0.0 ? 0.0 : lft) < 0) return -1;
    }
    Py_ssize_t lo = i > 0 ? i - 1 : 0;
    Py_ssize_t n = PyList_GET_SIZE(times) - 1;
    Py_ssize_t k = j + 1 < n ? j + 1 : n;
    while (k > lo) {
        if (fabs(F(residual, k) - F(residual, k - 1)) <= eps) {
            if (list_del(times, k) < 0 || list_del(residual, k) < 0) return -1;
        }
        k -= 1;
    }
    return 0;
}

int lane_of(PyObject *tl, Lane *out) {
    PyObject *times = PyObject_GetAttr(tl, str_times);
    if (times == NULL) return -1;
    PyObject *residual = PyObject_GetAttr(tl, str_residual);
    if (residual == NULL) {
        Py_DECREF(times);
        return -1;
    }
    PyObject *eps = PyObject_GetAttr(tl, str_eps);
    /* the timeline keeps its lists alive for as long as we use them */
    Py_DECREF(times);
    Py_DECREF(residual);
    if (eps == NULL) return -1;
    out->eps = PyFloat_AsDouble(eps);
    Py_DECREF(eps);
    if (out->eps == -1.0 && PyErr_Occurred()) return -1;
    if (!PyList_CheckExact(times) || !PyList_CheckExact(residual)) {
        PyErr_SetString(PyExc_TypeError, "a timeline's times and residual must be lists");
        return -1;
    }
    out->times = times;
    out->residual = residual;
    out->tl = tl;
    return 0;
}

/* ------------------------------------------------------------------ Timelines.transfer */

typedef struct {
    PyObject *lo, *hi; /* new references */
    double rate;
} Piece;

typedef struct {
    Piece *p;
    Py_ssize_t n, cap;
} Pieces;

static void pieces_free(Pieces *ps) {
    for (Py_ssize_t k = 0; k < ps->n; k++) {
        Py_XDECREF(ps->p[k].lo);
        Py_XDECREF(ps->p[k].hi);
    }
    PyMem_Free(ps->p);
    ps->p = NULL;
    ps->n = ps->cap = 0;
}

/* append (t, hi, rate), merging with the last piece as _walk does; steals nothing */
static int pieces_add(Pieces *ps, PyObject *t, PyObject *hi, double rate) {
    if (ps->n > 0) {
        Piece *last = &ps->p[ps->n - 1];
        if (last->rate == rate && PyFloat_AS_DOUBLE(last->hi) == PyFloat_AS_DOUBLE(t)) {
            Py_INCREF(hi);
            Py_SETREF(last->hi, hi);
            return 0;
        }
    }
    if (ps->n == ps->cap) {
        Py_ssize_t cap = ps->cap ? 2 * ps->cap : 8;
        Piece *np = PyMem_Realloc(ps->p, cap * sizeof(Piece));
        if (np == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ps->p = np;
        ps->cap = cap;
    }
    Py_INCREF(t);
    Py_INCREF(hi);
    ps->p[ps->n].lo = t;
    ps->p[ps->n].hi = hi;
    ps->p[ps->n].rate = rate;
    ps->n++;
    return 0;
}


/* Timelines._walk with record=True over the lanes. 1: done (start in *start_o, new ref);
   0: never has residual bandwidth; -1: error. */
static int walk(Lane *lanes, Py_ssize_t nl, double nbytes, PyObject *ready, Pieces *ps, PyObject **start_o,
                PyObject **end_o) {
    double cap = INFINITY;
    Lane *var[MAX_LINKS];
    Py_ssize_t n = 0;
    *start_o = *end_o = NULL;
    if (nl == 0 || nbytes <= 0) {
        Py_INCREF(ready);
        Py_INCREF(ready);
        *start_o = ready;
        *end_o = ready;
        return 1;
    }
    for (Py_ssize_t k = 0; k < nl; k++) {
        Lane *l = &lanes[k];
        if (PyList_GET_SIZE(l->times) == 1) {
            double r = F(l->residual, 0);
            if (r <= l->eps) return 0;
            cap = cap < r ? cap : r; /* min(cap, r) */
        } else {
            var[n++] = l;
        }
    }
    PyObject *t_o = ready;
    double t = PyFloat_AS_DOUBLE(ready);
    double remaining = nbytes;
    if (n == 0) {
        PyObject *fin = PyFloat_FromDouble(t + remaining / cap);
        if (fin == NULL) return -1;
        if (pieces_add(ps, t_o, fin, cap) < 0) {
            Py_DECREF(fin);
            return -1;
        }
        Py_INCREF(t_o);
        *start_o = t_o;
        *end_o = fin;
        return 1;
    }
    Py_ssize_t index[MAX_LINKS];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = bisect_right(var[k]->times, t, 0) - 1;
        index[k] = i < 0 ? 0 : i;
    }
    PyObject *start = NULL; /* borrowed until returned */
    for (;;) {
        double rate = cap, nxt = INFINITY, blocked = -INFINITY;
        PyObject *nxt_o = NULL, *blocked_o = NULL;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *times = var[k]->times;
            Py_ssize_t i = index[k], last = PyList_GET_SIZE(times) - 1;
            while (i < last && F(times, i + 1) <= t) i++;
            index[k] = i;
            double r = F(var[k]->residual, i);
            double following = i < last ? F(times, i + 1) : INFINITY;
            PyObject *following_o = i < last ? PyList_GET_ITEM(times, i + 1) : NULL;
            if (r <= var[k]->eps) {
                r = 0.0;
                if (following > blocked) {
                    blocked = following;
                    blocked_o = following_o;
                }
            }
            if (r < rate) rate = r;
            if (following < nxt) {
                nxt = following;
                nxt_o = following_o;
            }
        }
        if (rate <= 0.0) {
            if (blocked == INFINITY) return 0;
            t = blocked;
            t_o = blocked_o;
            continue;
        }
        if (start == NULL) start = t_o;
        double finish = t + remaining / rate;
        int done = finish <= nxt;
        PyObject *fin = NULL, *hi;
        if (done) {
            fin = PyFloat_FromDouble(finish);
            if (fin == NULL) return -1;
            hi = fin;
        } else {
            hi = nxt_o;
        }
        if (pieces_add(ps, t_o, hi, rate) < 0) {
            Py_XDECREF(fin);
            return -1;
        }
        if (done) {
            Py_INCREF(start);
            *start_o = start;
            *end_o = fin;
            return 1;
        }
        remaining -= rate * (nxt - t);
        t = nxt;
        t_o = nxt_o;
    }
}

/* Timelines._reserve_pieces: every piece reserved on every link of `links` (their lanes), link
   by link; the Reservation tuples (`cls`; None: reserved, no tuples made, () returned), NULL on error */
static PyObject *reserve_pieces(Lane *lanes, PyObject *links, Pieces *ps, PyObject *who, PyObject *cls) {
    Py_ssize_t nl = PyTuple_GET_SIZE(links), m = 0;
    if (cls == Py_None) {
        for (Py_ssize_t k = 0; k < nl; k++)
            for (Py_ssize_t q = 0; q < ps->n; q++) {
                Piece *p = &ps->p[q];
                if (reserve_lists(lanes[k].times, lanes[k].residual, lanes[k].eps, p->lo, p->hi, p->rate, who) < 0)
                    return NULL;
            }
        return Py_NewRef(empty_tuple);
    }
    PyObject *res = PyTuple_New(nl * ps->n);
    if (res == NULL) return NULL;
    PyTypeObject *type = (PyTypeObject *)cls;
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *link = PyTuple_GET_ITEM(links, k);
        for (Py_ssize_t q = 0; q < ps->n; q++) {
            Piece *p = &ps->p[q];
            PyObject *r = NULL, *rate = NULL;
            if (reserve_lists(lanes[k].times, lanes[k].residual, lanes[k].eps, p->lo, p->hi, p->rate, who) == 0 &&
                (r = type->tp_alloc(type, 4)) != NULL)
                rate = PyFloat_FromDouble(p->rate);
            if (rate == NULL) {
                Py_XDECREF(r);
                Py_DECREF(res);
                return NULL;
            }
            PyTuple_SET_ITEM(r, 0, Py_NewRef(link));
            PyTuple_SET_ITEM(r, 1, Py_NewRef(p->lo));
            PyTuple_SET_ITEM(r, 2, Py_NewRef(p->hi));
            PyTuple_SET_ITEM(r, 3, rate);
            PyTuple_SET_ITEM(res, m++, r);
        }
    }
    return res;
}

/* The walk and reservation of one transfer over `links` (a tuple of links): (start, end,
   reservations) (() where `cls` is None: none made), None where the Python loops are to run
   (nothing changed then), NULL on error. */
PyObject *fast_transfer(PyObject *tls, PyObject *links, double nbytes, PyObject *ready, PyObject *who,
                               PyObject *cls) {
    Py_ssize_t nl = PyTuple_GET_SIZE(links);
    if (nl > MAX_LINKS || !PyFloat_CheckExact(ready)) Py_RETURN_NONE;
    Lane lanes[MAX_LINKS];
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *tl = PyDict_GetItemWithError(tls, PyTuple_GET_ITEM(links, k));
        if (tl == NULL) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (lane_of(tl, &lanes[k]) < 0) return NULL;
        if (!all_floats(lanes[k].times) || !all_floats(lanes[k].residual)) Py_RETURN_NONE;
    }
    return lanes_transfer(lanes, links, nbytes, ready, who, cls);
}

/* fast_transfer over lanes already read (one per link of `links`, float lists): the walk and
   the reservation, (start, end, reservations), None where the path never has residual
   bandwidth (nothing changed), NULL on error. */
PyObject *lanes_transfer(Lane *lanes, PyObject *links, double nbytes, PyObject *ready, PyObject *who, PyObject *cls) {
    Py_ssize_t nl = PyTuple_GET_SIZE(links);
    Pieces ps = {NULL, 0, 0};
    PyObject *start = NULL, *end = NULL, *res = NULL;
    int got = walk(lanes, nl, nbytes, ready, &ps, &start, &end);
    if (got <= 0) {
        pieces_free(&ps);
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    res = reserve_pieces(lanes, links, &ps, who, cls);
    if (res == NULL) goto fail;
    pieces_free(&ps);
    PyObject *out = PyTuple_Pack(3, start, end, res);
    Py_DECREF(start);
    Py_DECREF(end);
    Py_DECREF(res);
    return out;
fail:
    pieces_free(&ps);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(res);
    return NULL;
}

PyObject *py_transfer(PyObject *self, PyObject *args) {
    PyObject *tls, *links, *ready, *who, *cls;
    double nbytes;
    if (!PyArg_ParseTuple(args, "O!O!dOOO", &PyDict_Type, &tls, &PyTuple_Type, &links, &nbytes, &ready, &who, &cls))
        return NULL;
    return fast_transfer(tls, links, nbytes, ready, who, cls);
}

/* ten(tls, timelines, links, nbytes, ready) -> (start, end) | None: Timelines.ten's walk.
   Missing timelines are made first, in path order, by tls.link (as the walk makes them), up to
   a link that never has residual bandwidth; None, with the same timelines made, where the
   Python walk is to run (it raises then, or a time is not a float). */
PyObject *py_ten(PyObject *self, PyObject *args) {
    PyObject *tls_obj, *tls, *links, *ready;
    double nbytes;
    if (!PyArg_ParseTuple(args, "OO!O!dO", &tls_obj, &PyDict_Type, &tls, &PyTuple_Type, &links, &nbytes, &ready))
        return NULL;
    Py_ssize_t nl = PyTuple_GET_SIZE(links);
    if (nl > MAX_LINKS || !PyFloat_CheckExact(ready)) Py_RETURN_NONE;
    if (nl == 0 || nbytes <= 0) return PyTuple_Pack(2, ready, ready);
    Lane lanes[MAX_LINKS];
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *link = PyTuple_GET_ITEM(links, k);
        PyObject *tl = PyDict_GetItemWithError(tls, link);
        if (tl == NULL) {
            if (PyErr_Occurred()) return NULL;
            tl = PyObject_CallMethodOneArg(tls_obj, str_link, link); /* makes it (or raises) */
            if (tl == NULL) return NULL;
            Py_DECREF(tl); /* the timelines hold it */
        }
        if (lane_of(tl, &lanes[k]) < 0) return NULL;
        if (!all_floats(lanes[k].times) || !all_floats(lanes[k].residual)) Py_RETURN_NONE;
        if (PyList_GET_SIZE(lanes[k].times) == 1 && F(lanes[k].residual, 0) <= lanes[k].eps) Py_RETURN_NONE;
    }
    Pieces ps = {NULL, 0, 0};
    PyObject *start = NULL, *end = NULL;
    int got = walk(lanes, nl, nbytes, ready, &ps, &start, &end);
    pieces_free(&ps);
    if (got <= 0) return got < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *out = PyTuple_Pack(2, start, end);
    Py_DECREF(start);
    Py_DECREF(end);
    return out;
}

/* copy_timelines(timelines, LinkTimeline) -> dict: Timelines.copy's {link: tl.copy()}, each
   LinkTimeline copied here (its lists copied, its eps shared, as LinkTimeline.copy does);
   tl.copy() called for a timeline of another class. */
PyObject *py_copy_timelines(PyObject *self, PyObject *args) {
    PyObject *tls, *cls;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &tls, &PyType_Type, &cls)) return NULL;
    static PyObject *s_copy;
    if (s_copy == NULL && (s_copy = PyUnicode_InternFromString("copy")) == NULL) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    PyObject *link, *tl;
    Py_ssize_t pos = 0;
    while (PyDict_Next(tls, &pos, &link, &tl)) {
        PyObject *copy = NULL;
        if (Py_TYPE(tl) != (PyTypeObject *)cls) {
            copy = PyObject_CallMethodNoArgs(tl, s_copy);
        } else {
            PyObject *times = PyObject_GetAttr(tl, str_times);
            PyObject *residual = times ? PyObject_GetAttr(tl, str_residual) : NULL;
            PyObject *eps = residual ? PyObject_GetAttr(tl, str_eps) : NULL;
            PyObject *t2 = eps ? PySequence_List(times) : NULL, *r2 = t2 ? PySequence_List(residual) : NULL;
            if (r2 != NULL && (copy = PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty_tuple, NULL)) != NULL &&
                (PyObject_SetAttr(copy, str_times, t2) < 0 || PyObject_SetAttr(copy, str_residual, r2) < 0 ||
                 PyObject_SetAttr(copy, str_eps, eps) < 0))
                Py_CLEAR(copy);
            Py_XDECREF(times);
            Py_XDECREF(residual);
            Py_XDECREF(eps);
            Py_XDECREF(t2);
            Py_XDECREF(r2);
        }
        int rc = copy == NULL ? -1 : PyDict_SetItem(out, link, copy);
        Py_XDECREF(copy);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* ------------------------------------------------------------------ Timelines.reserve_until */

/* Timelines.reserve_until(links, start, end, who): the whole path residual over [start, end),
   piece by piece (Timelines._rate_at), reserved link by link; the Reservation tuples. The
   missing timelines made first, in path order (as _rate_at makes them). None, with nothing
   changed, where a time is not a float: the caller runs the Python loop. */
PyObject *py_reserve_until(PyObject *self, PyObject *args) {
    PyObject *tls_obj, *tls, *links, *start_o, *end_o, *who, *cls, *timeline_cls;
    double eps;
    if (!PyArg_ParseTuple(args, "OO!O!OOOOOd", &tls_obj, &PyDict_Type, &tls, &PyTuple_Type, &links, &start_o, &end_o,
                          &who, &cls, &timeline_cls, &eps))
        return NULL;
    Py_ssize_t nl = PyTuple_GET_SIZE(links);
    if (!PyFloat_CheckExact(start_o) || !PyFloat_CheckExact(end_o) || nl > MAX_LINKS) Py_RETURN_NONE;
    double start = PyFloat_AS_DOUBLE(start_o), end = PyFloat_AS_DOUBLE(end_o);
    if (!isfinite(end)) Py_RETURN_NONE; /* until forever: the Python loop */
    if (nl == 0 || end <= start) return PyTuple_New(0);
    Lane lanes[MAX_LINKS];
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *link = PyTuple_GET_ITEM(links, k);
        PyObject *tl = PyDict_GetItemWithError(tls, link);
        if (tl == NULL) {
            if (PyErr_Occurred() || make_timeline(tls_obj, tls, link, timeline_cls, eps) < 0) return NULL;
            if ((tl = PyDict_GetItemWithError(tls, link)) == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "reserve_until: no timeline made");
                return NULL;
            }
        }
        if (lane_of(tl, &lanes[k]) < 0) return NULL;
        if (!all_floats(lanes[k].times) || !all_floats(lanes[k].residual)) Py_RETURN_NONE;
    }
    Pieces ps = {NULL, 0, 0};
    PyObject *t_o = Py_NewRef(start_o), *res = NULL;
    double t = start;
    while (t < end) { /* _rate_at(links, t), then the piece up to min(nxt, end) */
        double rate = INFINITY, nxt = INFINITY;
        PyObject *nxt_o = NULL;
        for (Py_ssize_t k = 0; k < nl; k++) {
            PyObject *times = lanes[k].times;
            Py_ssize_t i = bisect_right(times, t, 0) - 1;
            if (i < 0) i = 0;
            double r = F(lanes[k].residual, i);
            if (r <= lanes[k].eps) r = 0.0;
            if (r < rate) rate = r;
            if (i + 1 < PyList_GET_SIZE(times) && F(times, i + 1) < nxt) {
                nxt = F(times, i + 1);
                nxt_o = PyList_GET_ITEM(times, i + 1);
            }
        }
        PyObject *hi_o = end < nxt ? end_o : nxt_o; /* min(nxt, end) */
        Py_INCREF(hi_o);
        int rc = 0;
        if (rate > 0) { /* not merged with the last piece: the Python keeps every piece */
            if (ps.n == ps.cap) {
                Py_ssize_t cap = ps.cap ? 2 * ps.cap : 8;
                Piece *np = PyMem_Realloc(ps.p, cap * sizeof(Piece));
                if (np == NULL) {
                    PyErr_NoMemory();
                    rc = -1;
                } else {
                    ps.p = np;
                    ps.cap = cap;
                }
            }
            if (rc == 0) {
                ps.p[ps.n].lo = Py_NewRef(t_o);
                ps.p[ps.n].hi = Py_NewRef(hi_o);
                ps.p[ps.n].rate = rate;
                ps.n++;
            }
        }
        Py_SETREF(t_o, hi_o);
        if (rc < 0) goto fail;
        t = PyFloat_AS_DOUBLE(t_o);
    }
    res = reserve_pieces(lanes, links, &ps, who, cls);
    if (res == NULL) goto fail;
    pieces_free(&ps);
    Py_DECREF(t_o);
    return res;
fail:
    pieces_free(&ps);
    Py_XDECREF(t_o);
    Py_XDECREF(res);
    return NULL;
}
