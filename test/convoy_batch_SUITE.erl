%% convoy:batch/1 with a peer node: the calls inside a scope are collected and
%% leave together (one send_many/1 for a run of sends), in order and counted as
%% the same calls outside; they leave earlier before a call, a flush, send/3 or a
%% nested batch, at max_batch, and when the function raises; bad destinations
%% raise where they are written; local destinations get their message at once.
-module(convoy_batch_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").

-export([all/0, suite/0, init_per_testcase/2, end_per_testcase/2]).
-export([sends_leave_together/1, order_with_casts_and_multicasts/1,
         exception_sends_then_raises/1, call_and_flush_see_collected/1,
         nested_and_send3_leave_first/1, max_batch_bounds_a_scope/1,
         bad_destination_raises_there/1, local_at_once/1, not_running/1,
         names_pids_and_nodes_mixed/1]).
%% Run on the peer.
-export([tally/0]).

suite() ->
    [{timetrap, {seconds, 60}}].

all() ->
    [sends_leave_together, order_with_casts_and_multicasts, exception_sends_then_raises,
     call_and_flush_see_collected, nested_and_send3_leave_first, max_batch_bounds_a_scope,
     bad_destination_raises_there, local_at_once, not_running, names_pids_and_nodes_mixed].

init_per_testcase(not_running, Config) ->
    _ = application:stop(convoy),
    Config;
init_per_testcase(_TC, Config) ->
    ok = convoy_ct_peers:restart_here(),
    Config.

end_per_testcase(_TC, _Config) ->
    _ = application:stop(convoy),
    ok.

%%--------------------------------------------------------------------

%% 100 sends in a scope: none leaves before the scope ends, then one hand-over
%% carries them (send_many/1's); the node's counters are those of 100 sends.
sends_leave_together(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Sink = sink_on(Node),
    Before = accepted_and_direct(Node),
    Calls = traced(fun() ->
                           convoy:batch(fun() ->
                                                [ok = convoy:send(Sink, {m, I})
                                                 || I <- lists:seq(1, 100)],
                                                ?assertEqual(Before, accepted_and_direct(Node)),
                                                inside
                                        end)
                   end, [{convoy_send, together, 2}, {convoy_send, remote, 4}]),
    ?assertEqual([{convoy_send, together, 2}], Calls), % one hand-over for all 100
    ?assertEqual([{m, I} || I <- lists:seq(1, 100)], received(Sink, 100)),
    {A0, _} = Before,
    {A1, _} = accepted_and_direct(Node),
    ?assertEqual(100, A1 - A0). % each message handed to convoy once

%% Sends, casts and multicasts to several processes, interleaved: each receiver
%% gets its messages in the order they were written.
order_with_casts_and_multicasts(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    [S1, S2] = [sink_on(Node) || _ <- [1, 2]],
    Tally = spawn(Node, ?MODULE, tally, []),
    ok = convoy:batch(fun() ->
                              [begin
                                   ok = convoy:send(S1, {a, I}),
                                   ok = convoy:multicast([S1, S2], {all, I}),
                                   ok = convoy:cast(Tally, {add, I}),
                                   ok = convoy:send(S2, {b, I})
                               end || I <- lists:seq(1, 50)],
                              ok
                      end),
    ?assertEqual(lists:append([[{a, I}, {all, I}] || I <- lists:seq(1, 50)]), received(S1, 100)),
    ?assertEqual(lists:append([[{all, I}, {b, I}] || I <- lists:seq(1, 50)]), received(S2, 100)),
    %% the call comes behind every cast, collected or not
    ?assertEqual(lists:seq(1, 50), gen_server_call(Tally)).

%% An exception inside the scope: what was collected before it is sent, then the
%% exception goes on, class and reason unchanged.
exception_sends_then_raises(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Sink = sink_on(Node),
    ?assertThrow(stop, convoy:batch(fun() ->
                                            [ok = convoy:send(Sink, {m, I}) || I <- [1, 2, 3]],
                                            throw(stop)
                                    end)),
    ?assertExit(bye, convoy:batch(fun() -> ok = convoy:send(Sink, {m, 4}), exit(bye) end)),
    ?assertEqual([{m, 1}, {m, 2}, {m, 3}, {m, 4}], received(Sink, 4)),
    %% and the scope is gone: a send outside is not collected
    ok = convoy:send(Sink, {m, 5}),
    ?assertEqual([{m, 1}, {m, 2}, {m, 3}, {m, 4}, {m, 5}], received(Sink, 5)).

%% A call inside a scope sees the casts collected before it (they leave first:
%% no deadlock), and flush/0 sends what was collected, so a receive for an answer
%% to a message sent before the flush is answered.
call_and_flush_see_collected(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Tally = spawn(Node, ?MODULE, tally, []),
    Sink = sink_on(Node),
    Got = convoy:batch(fun() ->
                               [ok = convoy:cast(Tally, {add, I}) || I <- [1, 2, 3]],
                               All = convoy:call(Tally, all),
                               ok = convoy:send(Sink, {get, self()}),
                               ok = convoy:flush(),
                               receive {got, Sink, G} -> {All, G} after 5000 -> stuck end
                       end),
    ?assertEqual({[1, 2, 3], []}, Got).

%% A nested batch, send/3 and multicast/3 each send what was collected before them.
nested_and_send3_leave_first(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Sink = sink_on(Node),
    Calls = traced(fun() ->
                           convoy:batch(fun() ->
                                                ok = convoy:send(Sink, 1),
                                                ok = convoy:batch(fun() ->
                                                                          ok = convoy:send(Sink, 2)
                                                                  end),
                                                ok = convoy:send(Sink, 3),
                                                ok = convoy:send(Sink, 4, #{overload => error}),
                                                ok = convoy:send(Sink, 5),
                                                ok = convoy:multicast([Sink], 6, #{overload => error}),
                                                ok = convoy:send(Sink, 7)
                                        end)
                   end, [{convoy_send, remote, 4}]),
    %% each left alone, by send/2's path: 1 before the inner batch, 2 at its
    %% end, 3 before send/3, 4 (send/3 itself), 5 before multicast/3, 7 at the end
    ?assertEqual(6, length(Calls)),
    ?assertEqual([1, 2, 3, 4, 5, 6, 7], received(Sink, 7)).

%% At max_batch collected calls the scope sends them: 12 sends under max_batch 5
%% leave as 5, 5 and 2.
max_batch_bounds_a_scope(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    ok = convoy:set_config(#{max_batch => 5}),
    Sink = sink_on(Node),
    Calls = traced(fun() ->
                           convoy:batch(fun() -> [ok = convoy:send(Sink, I) || I <- lists:seq(1, 12)] end)
                   end, [{convoy_send, together, 2}]),
    ?assertEqual(3, length(Calls)),
    ?assertEqual(lists:seq(1, 12), received(Sink, 12)).

%% A scope's sends to a registered name, to pids of two nodes and to the first
%% node again: each receiver gets its messages in order, once.
names_pids_and_nodes_mixed(_Config) ->
    {PeerB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(mixed_b), #{}),
    {_, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(mixed_c), #{}),
    [SB, SC, Named] = [sink_on(N) || N <- [B, C, B]],
    true = peer:call(PeerB, erlang, register, [convoy_batch_named, Named]),
    ok = convoy:batch(fun() ->
                              [begin
                                   ok = convoy:send(SB, {b, I}),
                                   ok = convoy:send({convoy_batch_named, B}, {n, I}),
                                   ok = convoy:send(SC, {c, I})
                               end || I <- lists:seq(1, 30)],
                              ok
                      end),
    ?assertEqual([{b, I} || I <- lists:seq(1, 30)], received(SB, 30)),
    ?assertEqual([{c, I} || I <- lists:seq(1, 30)], received(SC, 30)),
    ?assertEqual([{n, I} || I <- lists:seq(1, 30)], received(Named, 30)),
    %% one node's pids alone: the same, through the one-node hand-over
    ok = convoy:batch(fun() -> [ok = convoy:send(SC, {again, I}) || I <- [1, 2, 3]], ok end),
    ?assertEqual([{again, I} || I <- [1, 2, 3]], lists:nthtail(30, received(SC, 33))).

%% A bad destination raises badarg at the call, as `!' would; what was collected
%% before it still leaves.
bad_destination_raises_there(_Config) ->
    {_Peer, Node} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(), #{}),
    Sink = sink_on(Node),
    ?assertError(badarg, convoy:batch(fun() ->
                                              ok = convoy:send(Sink, before),
                                              convoy:send({1, 2}, x)
                                      end)),
    ?assertError(badarg, convoy:batch(fun() -> convoy:multicast([Sink, "x"], y) end)),
    ?assertError(badarg, convoy:batch(not_a_fun)),
    ?assertEqual([before], received(Sink, 1)).

%% Local destinations are not collected: they get the message at once.
local_at_once(_Config) ->
    Self = self(),
    convoy:batch(fun() ->
                         ok = convoy:send(Self, here),
                         receive here -> ok after 0 -> ct:fail(not_at_once) end,
                         ok = convoy:multicast([Self], there),
                         receive there -> ok after 0 -> ct:fail(not_at_once) end
                 end).

%% Without convoy running, a scope's calls leave at its end as plain sends.
not_running(_Config) ->
    {_Peer, Node} = convoy_ct_peers:start(?MODULE, ?CT_PEER_NAME(), #{}),
    Sink = sink_on(Node),
    ok = convoy:batch(fun() -> [ok = convoy:send(Sink, I) || I <- [1, 2, 3]], ok end),
    ?assertEqual([1, 2, 3], received(Sink, 3)).

%%--------------------------------------------------------------------
%% Helpers

accepted_and_direct(Node) ->
    case maps:get(nodes, convoy:info()) of
        #{Node := #{accepted := A, direct := D}} -> {A, D};
        _ -> {0, 0}
    end.

%% The calls of `MFAs' Fun made in this process, in order.
traced(Fun, MFAs) ->
    Self = self(),
    Tracer = spawn_link(fun() -> collect_calls(Self, []) end),
    [_ = erlang:trace_pattern(MFA, true, [local]) || MFA <- MFAs],
    1 = erlang:trace(self(), true, [call, {tracer, Tracer}]),
    try
        Fun()
    after
        erlang:trace(self(), false, [call]),
        [_ = erlang:trace_pattern(MFA, false, [local]) || MFA <- MFAs]
    end,
    Ref = erlang:trace_delivered(self()),
    receive {trace_delivered, _, Ref} -> ok end,
    Tracer ! {get, self()},
    receive {calls, Calls} -> Calls end.

collect_calls(Owner, Acc) ->
    receive
        {trace, Owner, call, {M, F, Args}} -> collect_calls(Owner, [{M, F, length(Args)} | Acc]);
        {get, From} -> From ! {calls, lists:reverse(Acc)}
    end.

gen_server_call(Tally) ->
    Tally ! {all, self()},
    receive {tally, Tally, All} -> All after 5000 -> ct:fail(tally_silent) end.

sink_on(Node) ->
    convoy_ct_peers:sink_on(Node).

received(Sink, N) ->
    convoy_ct_peers:received(Sink, N).

%% A gen_server-shaped tally: casts `{add, I}' kept in order; `all' answered to a
%% call, or to `{all, From}'.
tally() ->
    tally([]).

tally(Acc) ->
    receive
        {'$gen_cast', {add, I}} -> tally([I | Acc]);
        {'$gen_call', From, all} -> gen:reply(From, lists:reverse(Acc)), tally(Acc);
        {all, From} -> From ! {tally, self(), lists:reverse(Acc)}, tally(Acc)
    end.
