%% The `ceiling' variant: how fast a batching router could be on this machine and
%% network, with none of convoy's bookkeeping (no admission counters, no bounds,
%% no accounting, no order rules beyond one process's own sends). A measurement,
%% not an API.
%%
%% Two forms, one per kind of scenario:
%% <ul>
%% <li>A sender that knows it sends many messages batches them itself
%%   (`oneway', `oneway8', `sizes'): lists of `max_batch' `{To, Msg}' entries go to
%%   the deliverer on the destination node, which delivers each with a local send.
%%   No local hop at all: the ceiling of what any batching can do for one sender.</li>
%% <li>Independent senders (`flood''s spawned pingers, the pong's answers) hand
%%   each message to their node's batcher, a process that collects what is in its
%%   mailbox (at most `max_batch' per node) and ships it to the deliverer when the
%%   mailbox is empty: convoy's own shape, one local hop and one batch, without its
%%   bookkeeping.</li>
%% </ul>
%% Both the batcher and the deliverer run on every node of the measurement and
%% live as long as the measurement (`start/1', `stop/1').
-module(convoy_bench_ceiling).

-export([start/1, stop/1, send/2, ship/2, batch_size/0]).
%% Spawned on the nodes taking part.
-export([init_deliverer/1, init_batcher/1]).

-define(DELIVERER, convoy_bench_ceiling_deliverer).
-define(BATCHER, convoy_bench_ceiling_batcher).

-type dest() :: pid() | {atom(), node()}.

%% @doc The entries in one shipped list: convoy's default `max_batch'.
-spec batch_size() -> pos_integer().
batch_size() ->
    maps:get(max_batch, convoy_config:defaults()).

%% @doc Start the deliverer and the batcher on each of `Nodes' (replacing any left
%% from an earlier measurement).
-spec start([node()]) -> ok.
start(Nodes) ->
    convoy_bench_router:start(?MODULE, Nodes, [{?DELIVERER, init_deliverer},
                                               {?BATCHER, init_batcher}]).

%% @doc Stop what `start/1' started.
-spec stop([node()]) -> ok.
stop(Nodes) ->
    convoy_bench_router:stop(Nodes, [?DELIVERER, ?BATCHER]).

%% @doc One message through this node's batcher (a local destination gets `!').
-spec send(dest(), term()) -> ok.
send(Dest, Msg) ->
    case node_of(Dest) =:= node() of
        true -> Dest ! Msg;
        false -> ?BATCHER ! {Dest, Msg}
    end,
    ok.

%% @doc A list of `{To, Msg}' entries, all for `Node', straight to its deliverer.
-spec ship(node(), [{dest(), term()}]) -> ok.
ship(Node, Entries) ->
    {?DELIVERER, Node} ! {deliver, Entries},
    ok.

node_of(Pid) when is_pid(Pid) -> node(Pid);
node_of({_Name, Node}) -> Node.

to(Pid) when is_pid(Pid) -> Pid;
to({Name, _Node}) -> Name.

%% @doc The deliverer (registered): local sends of every entry, in order.
-spec init_deliverer(pid()) -> no_return().
init_deliverer(Owner) ->
    true = register(?DELIVERER, self()),
    process_flag(message_queue_data, off_heap),
    Owner ! {started, node(), ?DELIVERER},
    deliver_loop().

deliver_loop() ->
    receive
        {deliver, Entries} -> [To ! Msg || {To, Msg} <- Entries]
    end,
    deliver_loop().

%% @doc The batcher (registered): collects while its mailbox has messages, at most
%% `batch_size/0' per node, then ships every node's list.
-spec init_batcher(pid()) -> no_return().
init_batcher(Owner) ->
    true = register(?BATCHER, self()),
    process_flag(message_queue_data, off_heap),
    Owner ! {started, node(), ?BATCHER},
    batch_loop(batch_size(), #{}).

batch_loop(Max, Lists) when map_size(Lists) =:= 0 ->
    receive
        {Dest, Msg} -> batch_loop(Max, add(Max, Dest, Msg, Lists))
    end;
batch_loop(Max, Lists) ->
    receive
        {Dest, Msg} -> batch_loop(Max, add(Max, Dest, Msg, Lists))
    after 0 ->
        maps:foreach(fun(Node, {_, L}) -> ship(Node, lists:reverse(L)) end, Lists),
        batch_loop(Max, #{})
    end.

add(Max, Dest, Msg, Lists) ->
    Node = node_of(Dest),
    Entry = {to(Dest), Msg},
    case Lists of
        #{Node := {N, L}} when N + 1 >= Max ->
            ship(Node, lists:reverse(L, [Entry])),
            maps:remove(Node, Lists);
        #{Node := {N, L}} ->
            Lists#{Node := {N + 1, [Entry | L]}};
        #{} ->
            Lists#{Node => {1, [Entry]}}
    end.
