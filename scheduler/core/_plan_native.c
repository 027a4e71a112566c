/*
 * mlfabric.scheduler.core._plan_native: the tree planner's per-update loops in C (issue 24).
 *
 * Each function runs the same arithmetic, in the same order, on the same Python objects as
 * the Python it stands in for (which stays, and runs where this module is not built), so a
 * plan is the same to the last bit: built with -ffp-contract=off (no fused multiply-add),
 * heaps ordered by the same keys and ties, dicts filled in the same order.
 *
 *   transfer(timelines, links, nbytes, ready, who, Reservation) -> (start, end, reservations) | None
 *       Timelines.transfer's walk and reservation: integrate the path residual of `links`
 *       from `ready` until `nbytes` are through (Timelines._walk, record=True), then
 *       subtract each piece's rate on every link (LinkTimeline.reserve, link by link) and
 *       return the Reservation tuples (none, (), where Reservation is None). `timelines` is
 *       Timelines._links (link -> LinkTimeline). None, with nothing changed, where a link
 *       has no timeline yet, a time is not a float, or the path never has residual
 *       bandwidth: the caller makes the timelines, or runs the Python loops (which raise). A
 *       reservation beyond the residual raises ValueError as LinkTimeline.reserve does.
 *
 *   ten(tls, timelines, links, nbytes, ready) -> (start, end) | None
 *       Timelines.ten: transfer's walk without reserving. Missing timelines are made by
 *       tls.link first, in path order, up to a link that never has residual bandwidth; None
 *       (the same timelines made) where the Python walk is to run: it raises, or a time is
 *       not a float.
 *
 *   copy_timelines(timelines, LinkTimeline) -> dict
 *       Timelines.copy: link -> a copy of its LinkTimeline (lists copied, eps shared).
 *
 *   reserve_until(tls, timelines, links, start, end, who, Reservation, LinkTimeline, EPS)
 *       -> reservations | None
 *       Timelines.reserve_until: the whole path residual of `links` over [start, end), piece
 *       by piece, reserved link by link (the missing timelines made first). None, with
 *       nothing changed, where a time is not a float: the Python loop runs.
 *
 *   reserve_tree(timelines, routes, order, nodes, parent, server, size, readies, now,
 *                Transfer, Reservation, fields) -> (transfers, makespan)
 *       tree_cost.reserve's loop: every payload of a tree reserved on the Timelines (the
 *       updates in `order`, each aggregate once its members are reserved), along
 *       routes.tree_path; each Transfer made with its `fields` filled in order (or by calling
 *       the class where `fields` is None).
 *
 *   estimate(updates, nodes, parent, server, order, routes, shared, now) -> float
 *       tree_cost.estimate (each link a first-come queue at its capacity), its whole loop:
 *       `updates` the (ready, bytes, id, source) tuples in the round's order, `nodes` the
 *       aggregates (aggregator, parent, members), `parent` payload id -> aggregate id,
 *       `order` the aggregate ids sorted (the Python heap's tie-break), `routes` a
 *       tree_routes.Routes and `shared` its in-tree routes' link ids by destination, then
 *       source (made here as _ServerRoutes.pair_ids makes them where a pair is not
 *       there yet); then routes.sync() and routes.free (copied), routes.per.
 *
 *   build(groups, depth, index, below, top, rank, host_of, points, prefix, bypass, fan_in,
 *         Node, fields) -> (nodes, parent)
 *       trees._build (with trees._sum): the aggregates of the candidate tree summing at
 *       `points` (the _Tree's fields passed one by one).
 *
 *   instances(cls, fields, rows) -> list
 *       cls(*row) for each row, for a dataclass whose __init__ only sets its `fields` (no
 *       __post_init__; the caller checks): each instance's dict filled in field order, as
 *       __init__ fills it, without running __init__ (a frozen dataclass's costs a call of
 *       object.__setattr__ per field).
 *
 *   stf_run(classes, class_of, class_of_key, on_first_link, book_on_link, popped, by_id, links_of,
 *           names, now, tau_max, server_version, ahead, limit, tls, tls._links, succ, start,
 *           profiles, Transfer, fields, Reservation, LinkTimeline, EPS, drop_reason, drops
 *           [, ix_of, link_list, cap_cache, class_index, keep, shared]) -> list of Transfer | None
 *       stf_planner.Planner.run, the STF loop (plan_stf.c, plan_stf_run.c, plan_stf_links.c).
 *       `shared`: member lists of the first classes, each from `now` with head 0, before
 *       `classes`' (start, members, head).
 *       With Reservation None, the timelines are reserved all the same but no reservation
 *       records are made, and each transfer is a row of the tuple class passed as Transfer
 *       (schedule.TransferTimes: payload id, src, dst, path, start, end, bytes, False),
 *       untracked by the cyclic collector.
 *
 *   changed_capacities(caps, succ) -> list of links
 *       stf_book.STFBook._recapacity's scan: the links of `caps` (link -> capacity) whose
 *       capacity in the graph's adjacency `succ` differs now, in `caps`' order
 *       (plan_stf_links.c).
 *
 *   tree_hosts(next_hops, hosts, lid, links, Host) -> None
 *       tree_routes._ServerRoutes._every: each node's path to the server and its link ids
 *       (a _Host, its slots set without its __init__, which only sets them), from its next
 *       hop's, new link ids made in `lid` / `links` (plan_routes.c).
 *
 *   tree_shape(tree, hosts, server, eligible, sources, every) -> (paths, below)
 *       tree_routes.RouteCache._shape's loops: the sources' paths, then every eligible host
 *       whose path crosses theirs, and the hosts below each node, in graph order
 *       (tree.host(h) called where `hosts` lacks h; a host with no path left out).
 *
 *   tree_bottlenecks(adj, next_hops, server) -> dict
 *       RouteCache.bottlenecks: each node's lowest capacity on its path to the server.
 *
 *   tree_dst(path, adj, lid, links, Dst) -> _Dst
 *       tree_routes._ServerRoutes._dst: what a route down to a host needs of its path
 *       (positions, the ids of the links back down while the graph has them, reversed).
 *
 *   tree_tables(order, paths, adj, eligible, below) -> (top, groups, depth, index, host_of)
 *       trees._tree's loops: the hosts with the fastest ingress below each node, the updates
 *       by the nodes between their source and the server, those nodes' depth, and each
 *       update's place and source.
 *
 *   update_rows(order, now) -> (rows, readies, sizes)
 *       The tree planner's per-update inputs: (max(ready_at, now), bytes, id, source) of
 *       each update (trees._plan_server's estimate input), max(ready_at, now) and id ->
 *       bytes (tree_cost.reserve's).
 *
 *   per_byte(adj, links) -> list of float
 *       tree_routes.Routes._grow: seconds per byte of each link (1 / its capacity).
 *
 *   decision_sends(transfers, after, ids, planned, Send, fields[, rows]) -> (sends, carried) | None
 *       convert.schedule_to_decision's loop over the transfers: the Sends of the payloads
 *       that are not the plan's aggregates, and payload id -> (transfer, after) of those
 *       that are (None where a transfer is a replica's: the Python loop runs).
 *
 *   follows(transfers, busy, ids[, rows]) -> list of tuples | None
 *       convert.schedule_to_decision's `after` of each transfer: the payloads ending on one
 *       of its links exactly when it starts (None where a link in flight is not a pair of
 *       nodes: the Python loop runs).
 *
 *   Both read a transfer of class `rows` (schedule.TransferTimes) by place.
 *
 *   dispatch_index(sends) -> (planned, pos, held, waiting, free) | None
 *       dispatch.Dispatcher.adopt's loops over a decision's sends (None where an update id is
 *       not a str or an `after` not a tuple: the Python loop runs).
 *
 *   list_diff(old, new) -> (fresh, gone) | None
 *       stf_book.STFBook.sync: the objects added to a list and taken out of it, by identity,
 *       where the new list is the old one less some, plus some after them (else None).
 */
#include "_plan_native.h"

PyObject *str_aggregator, *str_parent, *str_members, *str_free, *str_per, *str_grow, *str_hosts, *str_dsts,
    *str_host, *str_dst_m, *str_pair_ids, *str_path, *str_up, *str_pos, *str_down, *str_server, *str_tree,
    *empty_tuple, *str_walks, *str_back, *str_pair_path, *str_links, *str_link, *str_transfer, *str_end,
    *str_update_id, *str_src, *a_transfer, *str_start, *str_payload_id, *str_times, *str_residual, *str_eps,
    *fmt_over;

static PyMethodDef methods[] = {
    {"transfer", py_transfer, METH_VARARGS, "Timelines.transfer's walk and reservation (see the module doc)."},
    {"ten", py_ten, METH_VARARGS, "Timelines.ten's walk (see the module doc)."},
    {"copy_timelines", py_copy_timelines, METH_VARARGS, "Timelines.copy's timelines (see the module doc)."},
    {"reserve_tree", py_reserve_tree, METH_VARARGS, "tree_cost.reserve's loop (see the module doc)."},
    {"follows", py_follows, METH_VARARGS, "schedule_to_decision's `after` of each transfer (see the module doc)."},
    {"build", py_build, METH_VARARGS, "trees._build (see the module doc)."},
    {"instances", py_instances, METH_VARARGS, "Dataclass instances, their fields filled (see the module doc)."},
    {"reserve_until", py_reserve_until, METH_VARARGS, "Timelines.reserve_until (see the module doc)."},
    {"stf_run", py_stf_run, METH_VARARGS, "stf_planner.Planner.run (see plan_stf.c)."},
    {"changed_capacities", py_changed_capacities, METH_VARARGS, "STFBook._recapacity's scan (see the module doc)."},
    {"estimate", py_estimate, METH_VARARGS, "tree_cost.estimate's loop (see the module doc)."},
    {"tree_hosts", py_tree_hosts, METH_VARARGS, "tree_routes._ServerRoutes._every's loop (see the module doc)."},
    {"tree_shape", py_tree_shape, METH_VARARGS, "tree_routes.RouteCache._shape's loops (see the module doc)."},
    {"tree_bottlenecks", py_tree_bottlenecks, METH_VARARGS, "RouteCache.bottlenecks' loop (see the module doc)."},
    {"tree_dst", py_tree_dst, METH_VARARGS, "tree_routes._ServerRoutes._dst (see the module doc)."},
    {"tree_tables", py_tree_tables, METH_VARARGS, "trees._tree's loops (see the module doc)."},
    {"update_rows", py_update_rows, METH_VARARGS, "The tree planner's per-update rows (see the module doc)."},
    {"per_byte", py_per_byte, METH_VARARGS, "tree_routes.Routes._grow's per-byte times (see the module doc)."},
    {"decision_sends", py_decision_sends, METH_VARARGS, "schedule_to_decision's sends (see the module doc)."},
    {"dispatch_index", py_dispatch_index, METH_VARARGS, "Dispatcher.adopt's index of a plan (see the module doc)."},
    {"list_diff", py_list_diff, METH_VARARGS, "STFBook.sync's objects added and taken out (see the module doc)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plan_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan_native(void) {
    str_times = PyUnicode_InternFromString("times");
    str_residual = PyUnicode_InternFromString("residual");
    str_eps = PyUnicode_InternFromString("eps");
    str_aggregator = PyUnicode_InternFromString("aggregator");
    str_parent = PyUnicode_InternFromString("parent");
    str_members = PyUnicode_InternFromString("members");
    str_free = PyUnicode_InternFromString("free");
    str_per = PyUnicode_InternFromString("per");
    str_grow = PyUnicode_InternFromString("sync");
    str_hosts = PyUnicode_InternFromString("hosts");
    str_dsts = PyUnicode_InternFromString("dsts");
    str_host = PyUnicode_InternFromString("host");
    str_dst_m = PyUnicode_InternFromString("_dst");
    str_pair_ids = PyUnicode_InternFromString("pair_ids");
    str_path = PyUnicode_InternFromString("path");
    str_up = PyUnicode_InternFromString("up");
    str_pos = PyUnicode_InternFromString("pos");
    str_down = PyUnicode_InternFromString("down");
    str_server = PyUnicode_InternFromString("server");
    str_tree = PyUnicode_InternFromString("_tree");
    empty_tuple = PyTuple_New(0);
    str_walks = PyUnicode_InternFromString("walks");
    str_back = PyUnicode_InternFromString("back");
    str_pair_path = PyUnicode_InternFromString("pair_path");
    str_links = PyUnicode_InternFromString("_links");
    str_link = PyUnicode_InternFromString("link");
    str_transfer = PyUnicode_InternFromString("transfer");
    str_end = PyUnicode_InternFromString("end");
    str_update_id = PyUnicode_InternFromString("update_id");
    str_src = PyUnicode_InternFromString("src");
    a_transfer = PyUnicode_InternFromString("a transfer");
    str_start = PyUnicode_InternFromString("start");
    str_payload_id = PyUnicode_InternFromString("payload_id");
    if (!str_start || !str_payload_id) return NULL;
    if (!str_walks || !str_back || !str_pair_path || !str_links || !str_link || !str_transfer || !str_end ||
        !str_update_id || !str_src || !a_transfer)
        return NULL;
    if (!str_aggregator || !str_parent || !str_members || !str_free || !str_per || !str_grow || !str_hosts ||
        !str_dsts || !str_host || !str_dst_m || !str_pair_ids || !str_path || !str_up || !str_pos || !str_down ||
        !str_server || !str_tree || !empty_tuple)
        return NULL;
    fmt_over = PyUnicode_FromString("reserving {:g} B/s for {} at t={:g} exceeds the residual {:g} B/s");
    if (!str_times || !str_residual || !str_eps || !fmt_over) return NULL;
    return PyModule_Create(&module);
}
