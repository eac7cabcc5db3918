%% The `handover' variant: the limit of any design that hands each message to a
%% process, as convoy's lane does. A measurement, not an API.
%%
%% A sender hands each `{To, Msg}' to its node's batcher, one registered process
%% that collects what its mailbox holds and, each time the mailbox drains
%% (`receive ... after 0'), ships what it collected as one distribution message: a
%% list of up to `?MAX_BATCH' (1000, convoy's default `max_batch') `{To, Msg}'
%% entries, to the deliverer on the destination node, which delivers each entry
%% with `!'. Nothing else: no counters, no bounds, no accounting, no telemetry, no
%% order rules beyond one mailbox's. Entries are collected while they go to the same
%% node; an entry for another node ships what was collected first, so each sender's
%% messages to a process arrive in the order they were sent.
%%
%% The batcher and the deliverer run on every node of the measurement (node A's
%% batcher ships to B's deliverer, and B's, when B answers, to A's) and live as
%% long as the measurement (`start/1', `stop/1'), with convoy stopped.
-module(convoy_bench_handover).

-export([start/1, stop/1, send/2]).
%% Spawned on the nodes taking part.
-export([init_deliverer/1, init_batcher/1]).

-define(DELIVERER, convoy_bench_handover_deliverer).
-define(BATCHER, convoy_bench_handover_batcher).
-define(MAX_BATCH, 1000).

-type dest() :: pid() | {atom(), node()}.

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

%% @doc One message, handed to this node's batcher (a local destination gets `!').
-spec send(dest(), term()) -> ok.
send(Dest, Msg) ->
    case node_of(Dest) =:= node() of
        true -> Dest ! Msg;
        false -> ?BATCHER ! {Dest, Msg}
    end,
    ok.

-compile({inline, [node_of/1, to/1]}).
node_of(Pid) when is_pid(Pid) -> node(Pid);
node_of({_Name, Node}) -> Node.

to(Pid) when is_pid(Pid) -> Pid;
to({Name, _Node}) -> Name.

%% @doc The deliverer (registered): `!' to each entry of each list, in order.
-spec init_deliverer(pid()) -> no_return().
init_deliverer(Owner) ->
    true = register(?DELIVERER, self()),
    process_flag(message_queue_data, off_heap),
    Owner ! {started, node(), ?DELIVERER},
    deliver_loop().

deliver_loop() ->
    receive
        Entries -> deliver(Entries)
    end,
    deliver_loop().

deliver([]) -> ok;
deliver([{To, Msg} | Rest]) ->
    To ! Msg,
    deliver(Rest).

%% @doc The batcher (registered): collects while its mailbox has messages and they
%% go to one node, at most `?MAX_BATCH', then ships them as one list.
-spec init_batcher(pid()) -> no_return().
init_batcher(Owner) ->
    true = register(?BATCHER, self()),
    process_flag(message_queue_data, off_heap),
    Owner ! {started, node(), ?BATCHER},
    idle().

idle() ->
    receive
        {Dest, Msg} -> collect(node_of(Dest), 1, [{to(Dest), Msg}])
    end.

collect(Node, ?MAX_BATCH, Acc) ->
    ship(Node, Acc),
    idle();
collect(Node, N, Acc) ->
    receive
        {Dest, Msg} ->
            case node_of(Dest) of
                Node ->
                    collect(Node, N + 1, [{to(Dest), Msg} | Acc]);
                Other ->
                    ship(Node, Acc),
                    collect(Other, 1, [{to(Dest), Msg}])
            end
    after 0 ->
        ship(Node, Acc),
        idle()
    end.

ship(Node, Acc) ->
    {?DELIVERER, Node} ! lists:reverse(Acc),
    ok.
