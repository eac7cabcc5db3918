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
%%
%% The `guarded' variant (`send_guarded/2') is the same hand-over with only the
%% per-message work that convoy's promises need in the sender, and nothing
%% else: the settings read (one `persistent_term'), the message's size (large
%% messages take another path; the byte bound), the sender's marker read (order
%% across a path switch), and room taken in an exact bound of messages and bytes
%% held for the node (one `atomics:add_get/3' on one word, given back when it
%% does not fit, and by the batcher, per list, once shipped); a sender that
%% finds no room waits for it, as convoy's default `overload => block' does,
%% for at most `block_timeout' (5 s), polling the word. Its batcher is
%% another registered process beside the bare one. What it costs beside
%% `handover' is the floor of any design that keeps those promises per message.
-module(convoy_bench_handover).

-export([start/1, stop/1, send/2, send_guarded/2, guarded_batcher/0]).
%% Spawned on the nodes taking part.
-export([init_deliverer/1, init_batcher/1, init_guarded_batcher/1]).

-define(DELIVERER, convoy_bench_handover_deliverer).
-define(BATCHER, convoy_bench_handover_batcher).
-define(GUARDED_BATCHER, convoy_bench_handover_guarded).
-define(GUARD_KEY, {?MODULE, guard}).
-define(MARKED_KEY, {?MODULE, marked}).
-define(MAX_BATCH, 1000).
%% convoy's defaults: large_threshold, max_buffered, max_buffered_bytes.
-define(LARGE, 65536).
-define(MAX_MSGS, 1000000).
-define(MAX_BYTES, 64 * 1024 * 1024).
%% One held word: messages above BYTE_BITS, bytes below.
-define(BYTE_BITS, 40).
-define(MSG, (1 bsl ?BYTE_BITS)).
-define(BYTES_MASK, (?MSG - 1)).
%% convoy's default block_timeout, and how often a blocked sender looks for room.
-define(BLOCK_MS, 5000).
-define(ROOM_POLL_MS, 1).

-type dest() :: pid() | {atom(), node()}.

%% @doc Start the deliverer and the batcher on each of `Nodes' (replacing any left
%% from an earlier measurement).
-spec start([node()]) -> ok.
start(Nodes) ->
    convoy_bench_router:start(?MODULE, Nodes, [{?DELIVERER, init_deliverer},
                                               {?BATCHER, init_batcher},
                                               {?GUARDED_BATCHER, init_guarded_batcher}]).

%% @doc Stop what `start/1' started.
-spec stop([node()]) -> ok.
stop(Nodes) ->
    convoy_bench_router:stop(Nodes, [?DELIVERER, ?BATCHER, ?GUARDED_BATCHER]).

%% @doc One message, handed to this node's batcher (a local destination gets `!').
-spec send(dest(), term()) -> ok.
send(Dest, Msg) ->
    case node_of(Dest) =:= node() of
        true -> Dest ! Msg;
        false -> ?BATCHER ! {Dest, Msg}
    end,
    ok.

%% @doc One message, as `send/2' with the guarded variant's per-message work
%% (see the module's doc): `{error, overload}' when the node's bound is reached.
-spec send_guarded(dest(), term()) -> ok | {error, overload}.
send_guarded(Dest, Msg) ->
    Node = node_of(Dest),
    case Node =:= node() of
        true ->
            Dest ! Msg,
            ok;
        false ->
            guarded(persistent_term:get(?GUARD_KEY), Node, Dest, Msg)
    end.

guarded(Held, Node, Dest, Msg) ->
    case erlang:external_size(Msg) of
        Bytes when Bytes < ?LARGE ->
            marked(Node),
            hold(Held, ?MSG + Bytes, {Dest, Msg, Bytes}, undefined);
        _Large ->
            Dest ! Msg,
            ok
    end.

%% Room taken for one message (Add: one message and its bytes) and the message
%% handed over; without room, waits for it until a deadline, then refused.
hold(Held, Add, Handed, Deadline) ->
    W = atomics:add_get(Held, 1, Add),
    case W bsr ?BYTE_BITS =< ?MAX_MSGS andalso W band ?BYTES_MASK =< ?MAX_BYTES of
        true ->
            ?GUARDED_BATCHER ! Handed,
            ok;
        false ->
            atomics:sub(Held, 1, Add),
            Now = erlang:monotonic_time(millisecond),
            case Deadline of
                undefined ->
                    room_wait(Held, Add, Handed, Now + ?BLOCK_MS);
                _ when Now >= Deadline ->
                    {error, overload};
                _ ->
                    room_wait(Held, Add, Handed, Deadline)
            end
    end.

room_wait(Held, Add, Handed, Deadline) ->
    receive after ?ROOM_POLL_MS -> ok end,
    hold(Held, Add, Handed, Deadline).

marked(Node) ->
    case get(?MARKED_KEY) of
        #{Node := true} -> ok;
        undefined -> put(?MARKED_KEY, #{Node => true});
        Marked -> put(?MARKED_KEY, Marked#{Node => true})
    end.

%% @doc The guarded variant's batcher on this node (`undefined' when not started).
-spec guarded_batcher() -> pid() | undefined.
guarded_batcher() ->
    whereis(?GUARDED_BATCHER).

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

%% @doc The guarded variant's batcher (registered): the bare batcher's loop, each
%% shipped list's messages and bytes given back to the node's held word. It
%% creates that word and publishes it.
-spec init_guarded_batcher(pid()) -> no_return().
init_guarded_batcher(Owner) ->
    true = register(?GUARDED_BATCHER, self()),
    process_flag(message_queue_data, off_heap),
    Held = atomics:new(1, [{signed, false}]),
    persistent_term:put(?GUARD_KEY, Held),
    Owner ! {started, node(), ?GUARDED_BATCHER},
    guarded_idle(Held).

guarded_idle(Held) ->
    receive
        {Dest, Msg, Bytes} -> guarded_collect(Held, node_of(Dest), 1, Bytes, [{to(Dest), Msg}])
    end.

guarded_collect(Held, Node, ?MAX_BATCH, Bytes, Acc) ->
    guarded_ship(Held, Node, ?MAX_BATCH, Bytes, Acc),
    guarded_idle(Held);
guarded_collect(Held, Node, N, Bytes, Acc) ->
    receive
        {Dest, Msg, B} ->
            case node_of(Dest) of
                Node ->
                    guarded_collect(Held, Node, N + 1, Bytes + B, [{to(Dest), Msg} | Acc]);
                Other ->
                    guarded_ship(Held, Node, N, Bytes, Acc),
                    guarded_collect(Held, Other, 1, B, [{to(Dest), Msg}])
            end
    after 0 ->
        guarded_ship(Held, Node, N, Bytes, Acc),
        guarded_idle(Held)
    end.

guarded_ship(Held, Node, N, Bytes, Acc) ->
    ship(Node, Acc),
    atomics:sub(Held, 1, N * ?MSG + Bytes).
