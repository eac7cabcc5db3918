%% Fan-out with peer nodes: a multicast whose destinations on a node do not fit
%% in one entry travels as several, and each receiver still gets every sender's
%% messages in the order they were sent, multicasts and single sends mixed; a
%% node that goes down in the middle of a fan-out costs the other nodes nothing,
%% and what was handed over for it is counted.
-module(convoy_fanout_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([split_entries_keep_order/1, node_down_mid_fanout/1]).
%% Run on the peers.
-export([checkers/2, checker/1]).

suite() ->
    [{timetrap, {minutes, 3}}].

all() ->
    [split_entries_keep_order, node_down_mid_fanout].

init_per_testcase(_TC, Config) ->
    ok = convoy_ct_peers:restart_here(),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------

%% Two senders, each 40 rounds of: a single send to some of the receivers, then a
%% multicast to all 600 of them (two nodes, taking turns in the list) of a message
%% heavy enough that a node's 300 go as several entries. Every receiver gets
%% every message meant for it, each sender's in the order sent.
split_entries_keep_order(_Config) ->
    {_, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(split_b), #{}),
    {_, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(split_c), #{}),
    Receivers = interleave(checkers_on(B, 300), checkers_on(C, 300)),
    Pad = lists:seq(1, 900),
    PerEntry = convoy_wire:per_entry({x, 1, Pad}),
    ct:pal("destinations per entry: ~b", [PerEntry]),
    ?assert(PerEntry < 300 div 2), % each node's part is split
    Rounds = 40,
    Self = self(),
    _ = [spawn_link(fun() ->
                                  [begin
                                       Some = [R || {I, R} <- enumerate(Receivers),
                                                    (I + Round) rem 7 =:= 0],
                                       [ok = convoy:send(R, {Id, 2 * Round, []}) || R <- Some],
                                       ok = convoy:multicast(Receivers, {Id, 2 * Round + 1, Pad})
                                   end || Round <- lists:seq(1, Rounds)],
                                  Self ! {done, Id}
                          end) || Id <- [s1, s2]],
    [receive {done, Id} -> ok after 60000 -> ct:fail({sender_stuck, Id}) end
     || Id <- [s1, s2]],
    ok = convoy:flush(),
    Expected = fun(I) -> Rounds + length([R || R <- lists:seq(1, Rounds), (I + R) rem 7 =:= 0])
               end,
    [begin
         #{s1 := {N1, Bad1}, s2 := {N2, Bad2}} = report(R, 2 * Expected(I)),
         ?assertEqual({I, Expected(I), Expected(I), 0, 0}, {I, N1, N2, Bad1, Bad2})
     end || {I, R} <- enumerate(Receivers)].

%% One sender multicasts to 1,000 receivers on B and 1,000 on C, round after
%% round; C goes down after the 20th. Every multicast returns `ok' at once, B's
%% receivers get all of them in order, and for C what convoy accepted was shipped
%% or counted dropped, nothing held. convoy still sends to B afterwards.
node_down_mid_fanout(_Config) ->
    {_, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(down_b), #{}),
    {PeerC, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(down_c), #{}),
    OnB = checkers_on(B, 1000),
    Receivers = OnB ++ checkers_on(C, 1000),
    Rounds = 60,
    Self = self(),
    Sender = spawn_link(fun() ->
                                [begin
                                     Round =:= 21 andalso (Self ! {round, 21}),
                                     T0 = erlang:monotonic_time(millisecond),
                                     ok = convoy:multicast(Receivers, {s, Round, <<"event">>}),
                                     Took = erlang:monotonic_time(millisecond) - T0,
                                     Took < 2000 orelse exit({multicast_took_ms, Took})
                                 end || Round <- lists:seq(1, Rounds)],
                                Self ! sender_done
                        end),
    receive {round, 21} -> ok after 30000 -> ct:fail(no_round_21) end,
    ok = peer:stop(PeerC),
    receive sender_done -> ok after 60000 -> ct:fail({sender_stuck, Sender}) end,
    ok = convoy:flush(B),
    [?assertEqual(#{s => {Rounds, 0}}, report(R, Rounds)) || R <- OnB],
    %% C's counters: what was accepted is shipped or dropped, nothing held.
    Settled = convoy_ct_peers:await(
                fun() -> node_counters(C) end,
                fun(#{buffered := Bu, queued := Q}) -> Bu + Q =:= 0;
                   (none) -> true
                end, 20000),
    ct:pal("C's counters after it went down: ~p", [Settled]),
    case Settled of
        none -> ok;
        #{accepted := A, messages := M, dropped := D} -> ?assertEqual(A, M + D)
    end,
    %% still sending to B
    [Last | _] = OnB,
    ok = convoy:send(Last, {s, Rounds + 1, <<"after">>}),
    ?assertEqual(#{s => {Rounds + 1, 0}}, report(Last, Rounds + 1)).

%%--------------------------------------------------------------------

checkers_on(Node, N) ->
    erpc:call(Node, ?MODULE, checkers, [N, self()]).

%% @doc N receivers on this node (see `checker/1').
-spec checkers(pos_integer(), pid()) -> [pid()].
checkers(N, _Driver) ->
    [spawn(?MODULE, checker, [#{}]) || _ <- lists:seq(1, N)].

%% @doc Per sender id: how many messages, and how many came out of order (a
%% number not above the last one from that sender).
-spec checker(map()) -> no_return().
checker(Seen) ->
    receive
        {report, From} ->
            From ! {report, self(), maps:map(fun(_, {N, Bad, _Last}) -> {N, Bad} end, Seen)},
            checker(Seen);
        {Id, Seq, _Payload} ->
            {N, Bad, Last} = maps:get(Id, Seen, {0, 0, 0}),
            Bad1 = case Seq > Last of true -> Bad; false -> Bad + 1 end,
            checker(Seen#{Id => {N + 1, Bad1, Seq}})
    end.

%% A receiver's report once it has Total messages in all (or after 20 s).
report(R, Total) ->
    convoy_ct_peers:await(fun() -> ask(R) end,
                          fun(Got) -> lists:sum([N || {N, _} <- maps:values(Got)]) >= Total end,
                          20000).

ask(R) ->
    R ! {report, self()},
    receive {report, R, Got} -> Got after 5000 -> ct:fail({silent, R}) end.

node_counters(Node) ->
    case maps:get(nodes, convoy:info()) of
        #{Node := Counters} -> Counters;
        #{} -> none
    end.

interleave([A | As], [B | Bs]) -> [A, B | interleave(As, Bs)];
interleave([], Bs) -> Bs;
interleave(As, []) -> As.

enumerate(L) -> lists:zip(lists:seq(1, length(L)), L).
