%% An inbox that owes a stalled node an answer (a barrier's, a piece's
%% acknowledgement) or takes a monitor of a process there never waits for that
%% node's connection: a third node's traffic through the same inbox keeps flowing
%% (a stalled node owed an answer).
%%
%% Three nodes: this one (A, one inbox), B and C. B sends A's inbox a batch that
%% needs an answer while the inbox is suspended (`sys:suspend/1'), B is stopped
%% (SIGSTOP) and A fills its connection to B (plain sends until the runtime says
%% `nosuspend'); then the inbox is resumed and must answer B. C's messages to A,
%% all through that inbox, must all arrive within a bound far under the stall,
%% and the inbox is never found suspended on the connection. Once B resumes, it
%% gets its answer.
-module(convoy_inbox_stall_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, init_per_testcase/2, end_per_testcase/2]).
-export([barrier_for_stalled_node/1, piece_from_stalled_node/1]).
%% Run on the peers.
-export([collector_alias/1, send_from_c/2]).

%% C's messages, and how long they may take to arrive while B is stalled (B
%% stays stopped until they did or this has passed); A's filling sends.
-define(FROM_C, 2000).
-define(BOUND_MS, 3000).
-define(FILL_BYTES, (1 bsl 20)).
-define(MAX_FILL, 2000).

all() ->
    [barrier_for_stalled_node, piece_from_stalled_node].

init_per_testcase(_TC, Config) ->
    _ = application:stop(convoy),
    Config.

end_per_testcase(_TC, _Config) ->
    convoy_ct_peers:stop_local().

%%--------------------------------------------------------------------
%% Cases

%% The inbox answers a barrier of B's while B is stalled.
barrier_for_stalled_node(_Config) ->
    stalled_answer(fun(ReplyTo, _Keeper, _To) ->
                           Tag = make_ref(),
                           {[convoy_wire:barrier(ReplyTo, Tag)],
                            fun(Got) -> lists:member({Tag, convoy_barrier}, Got) end}
                   end, barrier).

%% The inbox takes a monitor of the keeper named in B's start piece, and
%% acknowledges the piece, while B is stalled (the message is never completed).
piece_from_stalled_node(_Config) ->
    stalled_answer(fun(Ref, Keeper, To) ->
                           {[convoy_wire:piece_start(Ref, Keeper, To, binary, 100, <<"x">>)],
                            fun(Got) -> lists:member({Ref, convoy_piece, 0}, Got) end}
                   end, piece).

%%--------------------------------------------------------------------
%% The scenario

stalled_answer(Entries, Kind) ->
    convoy_ct_peers:start_local(#{}),
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(stall_b), #{}),
    {PeerC, _C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(stall_c), #{}),
    A = node(),
    [await_peer_route(P, A) || P <- [PeerB, PeerC]],
    Inbox = whereis(convoy_inbox_1),
    %% B's collector of answers (an alias of it stands for a piece's reference),
    %% and a sink for A's filling sends.
    Collector = spawn(B, fun() -> collector([]) end),
    ReplyTo = peer:call(PeerB, ?MODULE, collector_alias, [Collector]),
    Sink = spawn(A, fun() -> counter(0) end),
    SinkB = spawn(B, fun Drop() -> receive _ -> Drop() end end),
    {Wire, Answered} = Entries(ReplyTo, Collector, Sink),
    %% B's batch waits in the suspended inbox's mailbox.
    ok = sys:suspend(Inbox),
    ok = peer:call(PeerB, erlang, send, [{convoy_inbox_1, A}, convoy_wire:batch(B, Wire), []]),
    convoy_ct_peers:await(fun() -> element(2, process_info(Inbox, message_queue_len)) end,
                          fun(N) -> N >= 1 end, 5000),
    OsPid = peer:call(PeerB, os, getpid, []),
    os:cmd("kill -STOP " ++ OsPid),
    Result =
        try
            Fills = fill(SinkB, 0),
            ct:pal("~p: A's connection to B busy after ~p MiB", [Kind, Fills]),
            ok = sys:resume(Inbox),
            T0 = erlang:monotonic_time(millisecond),
            ok = peer:call(PeerC, ?MODULE, send_from_c, [Sink, ?FROM_C]),
            {Got, States} = count_until(Sink, Inbox, T0 + ?BOUND_MS, []),
            Ms = erlang:monotonic_time(millisecond) - T0,
            ct:pal("~p: ~p of ~p of C's messages delivered in ~p ms with B stalled; "
                   "inbox states seen: ~p", [Kind, Got, ?FROM_C, Ms, lists:usort(States)]),
            {Got, States}
        after
            os:cmd("kill -CONT " ++ OsPid)
        end,
    {GotC, Seen} = Result,
    ?assertEqual(?FROM_C, GotC),
    ?assertEqual([], [St || St <- Seen, St =/= ok]),
    %% B gets its answer once it runs again.
    convoy_ct_peers:await(fun() -> answers(Collector) end, Answered, 30000),
    ok.

%% What the inbox was doing at each poll: ok, or how it was held.
count_until(Sink, Inbox, Deadline, States) ->
    St = inbox_state(Inbox),
    Sink ! {count, self()},
    N = receive {count, Sink, K} -> K end,
    case N >= ?FROM_C orelse erlang:monotonic_time(millisecond) > Deadline of
        true -> {N, [St | States]};
        false -> receive after 10 -> count_until(Sink, Inbox, Deadline, [St | States]) end
    end.

inbox_state(Inbox) ->
    case process_info(Inbox, [status, current_function]) of
        [{status, suspended}, _] -> suspended;
        [_, {current_function, {erts_internal, dsend_continue_trap, _}}] -> dsend_continue_trap;
        [_, {current_function, {erlang, monitor, _}}] -> in_monitor;
        _ -> ok
    end.

%% Plain sends of 1 MiB to B until the runtime reports the connection busy.
fill(_SinkB, N) when N >= ?MAX_FILL ->
    ct:fail({connection_never_busy, N});
fill(SinkB, N) ->
    case erlang:send(SinkB, binary:copy(<<"f">>, ?FILL_BYTES), [nosuspend]) of
        ok -> fill(SinkB, N + 1);
        nosuspend -> N
    end.

await_peer_route(Peer, Node) ->
    convoy_ct_peers:await(fun() -> convoy_ct_peers:route_kind(peer:call(Peer, convoy_peers, route, [Node])) end,
                          fun(K) -> K =:= convoy end, 10000).

answers(Collector) ->
    Collector ! {answers, self()},
    receive {answers, Collector, Got} -> Got after 5000 -> [] end.

%%--------------------------------------------------------------------
%% On the peers

%% @private An alias of Collector (made by Collector itself).
collector_alias(Collector) ->
    Collector ! {alias, self()},
    receive {alias, Collector, Alias} -> Alias end.

collector(Got) ->
    receive
        {alias, From} ->
            From ! {alias, self(), alias()},
            collector(Got);
        {answers, From} ->
            From ! {answers, self(), lists:reverse(Got)},
            collector(Got);
        Msg ->
            collector([Msg | Got])
    end.

counter(N) ->
    receive
        {count, From} ->
            From ! {count, self(), N},
            counter(N);
        {from_c, _} ->
            counter(N + 1)
    end.

%% @private C sends N messages to Sink (on A) through convoy.
send_from_c(Sink, N) ->
    [ok = convoy:send(Sink, {from_c, I}) || I <- lists:seq(1, N)],
    ok.
