%% @private
%% The caller's `convoy:batch/1' scope: the remote calls collected in it, newest
%% first, with their count, the `max_batch' read when the scope opened, and their
%% one node when they are all sends to pids (or aliases) of one node. One
%% entry of the caller's process dictionary, apart from the sender's state
%% (`convoy_sender'): a collected call costs one small tuple, not a rewrite of
%% that state. `convoy_route' decides what the calls become when they leave.
-module(convoy_scope).

-export([is_open/0, open/1, close/0, collect_send/3, collect/1, take/0]).

-export_type([item/0, nodes/0]).

-define(KEY, '$convoy_scope').

-compile({inline, [add/3, one_node/2]}).

%% A collected call: a send (destination and message, as the caller gave them),
%% or a multicast's (checked) remote destinations by node.
-type item() :: {convoy:dest(), term()} | {multicast, #{node() => [convoy:dest()]}, term()}.
%% The node of every collected call when they are all sends to pids or aliases of
%% that node (the calls are then that node's messages as they are); `mixed'
%% otherwise; `none' when nothing is collected.
-type nodes() :: node() | mixed | none.
%% What `collect_send/3' and `collect/1' did: `none' outside a scope; `full' when
%% the scope holds `max_batch' calls (the caller sends them).
-type collected() :: none | collected | full.

%% @doc Whether the caller is inside `convoy:batch/1'.
-spec is_open() -> boolean().
is_open() ->
    get(?KEY) =/= undefined.

%% @doc The caller enters `convoy:batch/1' (not already inside one): nothing
%% collected, at most `MaxBatch' calls held.
-spec open(pos_integer()) -> ok.
open(MaxBatch) ->
    put(?KEY, {0, MaxBatch, none, []}),
    ok.

%% @doc The caller leaves `convoy:batch/1' (what it collected was taken).
-spec close() -> ok.
close() ->
    _ = erase(?KEY),
    ok.

%% @doc A send to `Dest' collected if the caller is inside a scope: `Node' the
%% node of `Dest', a pid or alias there (`mixed' for a registered name).
-spec collect_send(node() | mixed, convoy:dest(), term()) -> collected().
collect_send(Node, Dest, Msg) ->
    case get(?KEY) of
        {N, Max, Node, Items} when N + 1 < Max -> % the usual call: as the ones before
            put(?KEY, {N + 1, Max, Node, [{Dest, Msg} | Items]}),
            collected;
        undefined ->
            none;
        Scope ->
            add({Dest, Msg}, Node, Scope)
    end.

%% @doc `Item' (a multicast's) collected if the caller is inside a scope.
-spec collect(item()) -> collected().
collect(Item) ->
    case get(?KEY) of
        undefined -> none;
        Scope -> add(Item, mixed, Scope)
    end.

add(Item, Node, {N, Max, Nodes, Items}) ->
    put(?KEY, {N + 1, Max, one_node(Node, Nodes), [Item | Items]}),
    case N + 1 >= Max of
        true -> full;
        false -> collected
    end.

one_node(Node, Node) -> Node;
one_node(Node, none) -> Node;
one_node(_Node, _Nodes) -> mixed.

%% @doc What the scope collected, newest first, and their node (`nodes()'), the
%% scope left open and empty; `{none, []}' outside a scope.
-spec take() -> {nodes(), [item()]}.
take() ->
    case get(?KEY) of
        undefined -> {none, []};
        {0, _, _, _} -> {none, []};
        {_, Max, Nodes, Items} -> put(?KEY, {0, Max, none, []}), {Nodes, Items}
    end.
