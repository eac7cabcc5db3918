%% EUnit tests of convoy_channel on one node: the window, credits in batches,
%% timeouts, a dying consumer, close, options, telemetry and the node-wide stats.
%% (Remote consumers: convoy_channel_SUITE; random interleavings:
%% prop_convoy_channel_tests.)
-module(convoy_channel_tests).

-include_lib("eunit/include/eunit.hrl").

-export([window_respected/0, registered_consumer/0, timeout/0, timeout_zero/0,
         consumer_death/0, consumer_death_seen_by_info/0, close/0,
         other_process_sees_closed/0, bad_options/0, noproc/0, recv_and_ack/0,
         ack_dictionary/0, ack_sweep/0, ack_keys_bounded/0, producer_clean_after_close/0,
         telemetry_and_stats/0, telemetry_setting/0]).

%%--------------------------------------------------------------------
%% Helpers

%% A consumer that processes every channel message (a little hashing), checks
%% that it never has more than `Window' channel messages queued, acks, and on
%% `{done, From}' reports what it got and its peak queue length.
consumer(Window) ->
    spawn_link(fun() -> consume(Window, [], 0) end).

consume(Window, Got, Peak) ->
    {message_queue_len, Q} = process_info(self(), message_queue_len),
    ?assert(Q =< Window),
    case convoy_channel:recv(infinity) of
        {ok, Token, {done, From}} ->
            ok = convoy_channel:ack(Token),
            From ! {consumed, self(), lists:reverse(Got), max(Peak, Q)},
            receive stop -> ok end;
        {ok, Token, {item, I}} ->
            _ = [erlang:phash2({I, K}) || K <- lists:seq(1, 50)],
            ok = convoy_channel:ack(Token),
            consume(Window, [I | Got], max(Peak, Q))
    end.

%% A consumer that takes `Hold' channel messages without acking them, tells the
%% test, then waits for `{ack, N, From}' or `stop'.
holder(Hold) ->
    Test = self(),
    spawn(fun() -> hold(Test, Hold, []) end).

hold(Test, 0, Tokens) ->
    Test ! {holding, self()},
    hold_loop(lists:reverse(Tokens));
hold(Test, N, Tokens) ->
    {ok, Token, _} = convoy_channel:recv(infinity),
    hold(Test, N - 1, [Token | Tokens]).

hold_loop(Tokens) ->
    receive
        {ack, N, From} ->
            {Now, Later} = lists:split(N, Tokens),
            [ok = convoy_channel:ack(T) || T <- Now],
            From ! {acked, self()},
            hold_loop(Later);
        stop ->
            ok
    end.

send_n(_Ch, From, To) when From > To -> ok;
send_n(Ch, From, To) ->
    ok = convoy_channel:send(Ch, {item, From}),
    send_n(Ch, From + 1, To).

mailbox() ->
    {messages, Ms} = process_info(self(), messages),
    Ms.

%% convoy_channel's ACK_ROOM: partial ack counts a consumer may add between two
%% sweeps.
-define(ACK_ROOM, 1024).

%% The partial ack counts in the caller's dictionary.
ack_counts() ->
    [{Ref, V} || {{'$convoy_ack', Ref}, V} <- get()].

%% `N' partial ack counts of channels that are gone: each a channel to the caller,
%% closed once its one message is received, acked after the close.
dead_partials(0) ->
    ok;
dead_partials(N) ->
    {ok, Ch} = convoy_channel:open(self(), #{window => 2, ack_every => 2}),
    ok = convoy_channel:send(Ch, dead),
    Token = receive {convoy_channel, T, dead} -> T end,
    ok = convoy_channel:close(Ch),
    ok = convoy_channel:ack(Token),
    dead_partials(N - 1).

%% A consumer that acks `{item, _}', answers `{sync, From}' without acking it, and
%% reports how many partial ack counts it holds.
acker() ->
    receive
        {convoy_channel, Token, {item, _}} ->
            ok = convoy_channel:ack(Token),
            acker();
        {convoy_channel, _, {sync, From}} ->
            From ! {synced, self()},
            acker();
        {report, From} ->
            From ! {ack_counts, self(), length(ack_counts())},
            acker();
        stop ->
            ok
    end.

ack_counts(Consumer) ->
    Consumer ! {report, self()},
    receive {ack_counts, Consumer, N} -> N end.

%%--------------------------------------------------------------------
%% Tests

%% Each test in a fresh process: channels, credits and DOWNs live in the
%% caller's process dictionary and mailbox.
channel_test_() ->
    [{atom_to_list(Name), {spawn, {timeout, 30, fun() -> ?MODULE:Name() end}}}
     || Name <- [window_respected,
                 registered_consumer,
                 timeout,
                 timeout_zero,
                 consumer_death,
                 consumer_death_seen_by_info,
                 close,
                 other_process_sees_closed,
                 bad_options,
                 noproc,
                 recv_and_ack,
                 ack_dictionary,
                 ack_sweep,
                 ack_keys_bounded,
                 producer_clean_after_close,
                 telemetry_and_stats,
                 telemetry_setting]].

window_respected() ->
    [begin
         C = consumer(W),
         {ok, Ch} = convoy_channel:open(C, #{window => W}),
         ok = send_n(Ch, 1, N),
         ok = convoy_channel:send(Ch, {done, self()}),
         receive
             {consumed, C, Got, Peak} ->
                 ?assertEqual(lists:seq(1, N), Got),
                 ?assert(Peak =< W)
         end,
         #{state := open, in_flight := InFlight, credit := Credit, window := W} =
             convoy_channel:info(Ch),
         ?assert(InFlight =< W),
         ?assertEqual(W, InFlight + Credit),
         C ! stop,
         ok = convoy_channel:close(Ch)
     end || {W, N} <- [{1, 200}, {2, 500}, {10, 3000}, {100, 5000}]],
    ok.

registered_consumer() ->
    C = consumer(20),
    true = register(convoy_channel_test_consumer, C),
    try
        {ok, Ch1} = convoy_channel:open(convoy_channel_test_consumer, #{window => 20}),
        {ok, Ch2} = convoy_channel:open({convoy_channel_test_consumer, node()}, #{window => 20}),
        ok = send_n(Ch1, 1, 100),
        ok = convoy_channel:send(Ch1, {done, self()}),
        receive {consumed, C, Got, _} -> ?assertEqual(lists:seq(1, 100), Got) end,
        ok = convoy_channel:close(Ch1),
        ok = convoy_channel:close(Ch2)
    after
        catch unregister(convoy_channel_test_consumer)
    end.

%% 1000 messages with window 100 (ack_every 50 by default) bring back exactly 20
%% credit messages of 50; with ack_every 10, 100 of 10; window 1, 1000 of 1.
credits_in_batches_test_() ->
    {timeout, 30,
     [?_assertEqual({20, 50}, credit_messages(#{window => 100}, 1000)),
      ?_assertEqual({100, 10}, credit_messages(#{window => 100, ack_every => 10}, 1000)),
      ?_assertEqual({1000, 1}, credit_messages(#{window => 1}, 1000)),
      ?_assertEqual({2, 500}, credit_messages(#{}, 1000))]}.

credit_messages(Opts, N) ->
    Test = self(),
    Producer = spawn_link(fun() ->
                                  receive go -> ok end,
                                  C = consumer(maps:get(window, Opts, 1000)),
                                  {ok, Ch} = convoy_channel:open(C, Opts),
                                  %% `done' is not acked before the report: N acks.
                                  ok = send_n(Ch, 1, N - 1),
                                  ok = convoy_channel:send(Ch, {done, self()}),
                                  receive {consumed, C, _, _} -> ok end,
                                  Test ! {produced, self()}
                          end),
    1 = erlang:trace(Producer, true, ['receive', {tracer, self()}]),
    Producer ! go,
    receive {produced, Producer} -> ok end,
    Ref = erlang:trace_delivered(Producer),
    receive {trace_delivered, Producer, Ref} -> ok end,
    Credits = [K || {trace, P, 'receive', {'$convoy_credit', _, K}} <- mailbox(),
                    P =:= Producer],
    flush_trace(),
    {length(Credits), lists:max(Credits)}.

flush_trace() ->
    receive {trace, _, _, _} -> flush_trace() after 0 -> ok end.

timeout() ->
    H = holder(3),
    {ok, Ch} = convoy_channel:open(H, #{window => 3, timeout => 50}),
    ok = send_n(Ch, 1, 3),
    receive {holding, H} -> ok end,
    T0 = erlang:monotonic_time(millisecond),
    ?assertEqual({error, timeout}, convoy_channel:send(Ch, {item, 4})),
    ?assert(erlang:monotonic_time(millisecond) - T0 >= 50),
    #{state := open, credit := 0, in_flight := 3, waits := 1, wait_time_us := Us} =
        convoy_channel:info(Ch),
    ?assert(Us >= 50000),
    %% Credit back: the channel carries on.
    H ! {ack, 2, self()},
    receive {acked, H} -> ok end,
    #{credit := 2, in_flight := 1} = convoy_channel:info(Ch),
    ok = send_n(Ch, 4, 5),
    ?assertEqual({error, timeout}, convoy_channel:send(Ch, {item, 6})),
    #{waits := 2} = convoy_channel:info(Ch),
    H ! stop,
    ok = convoy_channel:close(Ch).

timeout_zero() ->
    H = holder(1),
    {ok, Ch} = convoy_channel:open(H, #{window => 1, timeout => 0}),
    ok = convoy_channel:send(Ch, x),
    ?assertEqual({error, timeout}, convoy_channel:send(Ch, y)),
    H ! stop,
    ok = convoy_channel:close(Ch).

%% A producer blocked on a consumer that dies gets the error at once, and every
%% later send too; nothing else in its mailbox is touched.
consumer_death() ->
    H = holder(4),
    Test = self(),
    Producer = spawn_link(
                 fun() ->
                         self() ! {unrelated, 1},
                         {ok, Ch} = convoy_channel:open(H, #{window => 4}),
                         ok = send_n(Ch, 1, 4),
                         self() ! {unrelated, 2},
                         Test ! {blocking, self()},
                         R = convoy_channel:send(Ch, {item, 5}),
                         T = erlang:monotonic_time(millisecond),
                         Test ! {result, self(), R, T, convoy_channel:send(Ch, {item, 6}),
                                 convoy_channel:info(Ch), mailbox()}
                 end),
    receive {holding, H} -> ok end,
    receive {blocking, Producer} -> ok end,
    T0 = erlang:monotonic_time(millisecond),
    exit(H, kill),
    receive
        {result, Producer, R, T1, R2, Info, Mailbox} ->
            ?assertEqual({error, {consumer_down, killed}}, R),
            ?assertEqual({error, {consumer_down, killed}}, R2),
            ?assert(T1 - T0 < 1000),
            ?assertMatch(#{state := down, credit := 0, in_flight := 4, waits := 1}, Info),
            ?assertEqual([{unrelated, 1}, {unrelated, 2}], Mailbox)
    end.

%% Death seen by info/1 even with credit left; messages sent before are lost.
consumer_death_seen_by_info() ->
    H = holder(1),
    {ok, Ch} = convoy_channel:open(H, #{window => 5}),
    Mon = monitor(process, H),
    ok = convoy_channel:send(Ch, a),
    receive {holding, H} -> ok end,
    exit(H, kill),
    receive {'DOWN', Mon, process, H, killed} -> ok end,
    %% The channel's own DOWN comes from the same process; wait until it is here.
    ok = await_down(Ch),
    ?assertMatch(#{state := down, credit := 0, in_flight := 1}, convoy_channel:info(Ch)),
    ?assertEqual({error, {consumer_down, killed}}, convoy_channel:send(Ch, b)),
    ok = convoy_channel:close(Ch),
    ?assertEqual({error, closed}, convoy_channel:send(Ch, c)).

await_down(Ch) ->
    Ref = element(3, Ch),                      % the monitor
    case [x || {'DOWN', R, process, _, _} <- mailbox(), R =:= Ref] of
        [] -> erlang:yield(), await_down(Ch);
        _ -> ok
    end.

close() ->
    H = holder(2),
    {ok, Ch} = convoy_channel:open(H, #{window => 4, ack_every => 1}),
    ok = send_n(Ch, 1, 2),
    receive {holding, H} -> ok end,
    %% One credit waiting in the mailbox when the channel closes: flushed.
    H ! {ack, 1, self()},
    receive {acked, H} -> ok end,
    ?assertMatch([{'$convoy_credit', _, 1}], mailbox()),
    ok = convoy_channel:close(Ch),
    ?assertEqual([], mailbox()),
    %% A credit after close goes to a dead alias: dropped, not left in the mailbox.
    H ! {ack, 1, self()},
    receive {acked, H} -> ok end,
    ?assertEqual([], mailbox()),
    ?assertEqual({error, closed}, convoy_channel:send(Ch, x)),
    ?assertMatch(#{state := closed, credit := 0, in_flight := 0, window := 4},
                 convoy_channel:info(Ch)),
    ok = convoy_channel:close(Ch),
    %% The monitor is gone too: no DOWN when the consumer dies.
    Mon = monitor(process, H),
    H ! stop,
    receive {'DOWN', Mon, process, H, normal} -> ok end,
    ?assertEqual([], mailbox()).

%% A channel belongs to the process that opened it.
other_process_sees_closed() ->
    H = holder(1),
    {ok, Ch} = convoy_channel:open(H, #{}),
    Test = self(),
    spawn_link(fun() -> Test ! {other, convoy_channel:send(Ch, x)} end),
    receive {other, R} -> ?assertEqual({error, closed}, R) end,
    H ! stop,
    ok = convoy_channel:close(Ch).

bad_options() ->
    P = self(),
    [?assertEqual({error, E}, convoy_channel:open(P, Opts))
     || {Opts, E} <- [{#{windw => 3}, {bad_option, windw}},
                      {#{window => 0}, {bad_value, window, 0}},
                      {#{window => 1.5}, {bad_value, window, 1.5}},
                      {#{ack_every => 0}, {bad_value, ack_every, 0}},
                      {#{window => 10, ack_every => 11}, {bad_value, ack_every, 11}},
                      {#{ack_every => 1001}, {bad_value, ack_every, 1001}},
                      {#{timeout => -1}, {bad_value, timeout, -1}},
                      {#{timeout => soon}, {bad_value, timeout, soon}},
                      %% what `receive ... after' takes at most
                      {#{timeout => 16#100000000}, {bad_value, timeout, 16#100000000}}]],
    ?assertEqual([], [K || {{'$convoy_channel', _} = K, _} <- get()]),
    {ok, Kw} = convoy_channel:open(P, [{window, 3}]), % a keyword list as a map
    ?assertMatch(#{window := 3}, convoy_channel:info(Kw)),
    ok = convoy_channel:close(Kw),
    ?assertError(badarg, convoy_channel:open(P, window)),
    ?assertEqual({error, {not_a_map, [window]}}, convoy_channel:open(P, [window])),
    ?assertEqual({error, {duplicate_option, window}},
                 convoy_channel:open(P, [{window, 3}, {window, 4}])),
    ?assertError(badarg, convoy_channel:open("consumer", #{})),
    ?assertError(badarg, convoy_channel:open({a, b, c}, #{})),
    ?assertError(badarg, convoy_channel:ack(not_a_token)),
    ?assertError(badarg, convoy_channel:recv(-1)),
    ?assertError(badarg, convoy_channel:send(not_a_channel, x)),
    {ok, Ch} = convoy_channel:open(P, #{window => 10, ack_every => 10, timeout => 0}),
    ok = convoy_channel:close(Ch).

noproc() ->
    ?assertEqual({error, noproc}, convoy_channel:open(convoy_channel_nobody, #{})),
    ?assertEqual({error, noproc}, convoy_channel:open({convoy_channel_nobody, node()}, #{})),
    {Pid, Mon} = spawn_monitor(fun() -> ok end),
    receive {'DOWN', Mon, process, Pid, _} -> ok end,
    ?assertEqual({error, noproc}, convoy_channel:open(Pid, #{})).

%% The caller as its own consumer: recv/1 and ack/1 with ack_every 1.
recv_and_ack() ->
    {ok, Ch} = convoy_channel:open(self(), #{window => 2, ack_every => 1, timeout => 0}),
    self() ! unrelated,
    ?assertEqual(timeout, convoy_channel:recv(0)),
    ok = convoy_channel:send(Ch, one),
    ok = convoy_channel:send(Ch, two),
    ?assertEqual({error, timeout}, convoy_channel:send(Ch, three)),
    {ok, T1, one} = convoy_channel:recv(0),
    {ok, T2, two} = convoy_channel:recv(0),
    ?assertEqual(timeout, convoy_channel:recv(0)),
    ok = convoy_channel:ack(T1),
    #{credit := 1, in_flight := 1} = convoy_channel:info(Ch),
    ok = convoy_channel:ack(T2),
    %% A second ack of the same message does not widen the window.
    ok = convoy_channel:ack(T2),
    ?assertMatch(#{credit := 2, in_flight := 0}, convoy_channel:info(Ch)),
    ok = convoy_channel:close(Ch),
    ?assertEqual([unrelated], mailbox()),
    receive unrelated -> ok end.

%% The consumer keeps only partial ack counts in its dictionary.
ack_dictionary() ->
    {ok, Ch} = convoy_channel:open(self(), #{window => 4, ack_every => 3}),
    ok = send_n(Ch, 1, 4),
    Tokens = [T || _ <- lists:seq(1, 4), {ok, T, _} <- [convoy_channel:recv(0)]],
    Acks = fun() -> [V || {{'$convoy_ack', _}, V} <- get()] end,
    [T1, T2, T3, T4] = Tokens,
    ok = convoy_channel:ack(T1),
    ok = convoy_channel:ack(T2),
    ?assertEqual([2], Acks()),
    ok = convoy_channel:ack(T3),
    ?assertEqual([], Acks()),
    ok = convoy_channel:ack(T4),
    ?assertEqual([1], Acks()),
    #{credit := 3, in_flight := 1} = convoy_channel:info(Ch),
    ok = convoy_channel:close(Ch),
    [erase(K) || {{'$convoy_ack', _} = K, _} <- get()].

%% Second chance: a sweep marks the counts acked since the last one and returns
%% the others as credit, so a count left by a closed channel is gone two sweeps
%% later and a live channel's count is returned, never dropped.
ack_sweep() ->
    {ok, Ch} = convoy_channel:open(self(), #{window => 10, ack_every => 5}),
    ok = send_n(Ch, 1, 3),
    [T1, T2, T3] = [T || _ <- [1, 2, 3], {ok, T, _} <- [convoy_channel:recv(0)]],
    {Ref, 5} = T1,
    Live = fun() -> proplists:get_value(Ref, ack_counts()) end,
    ok = convoy_channel:ack(T1),
    ok = dead_partials(?ACK_ROOM - 1),
    %% The first sweep: every count is marked, none returned.
    ?assertEqual(?ACK_ROOM, length(ack_counts())),
    ?assertEqual([], [R || {R, V} <- ack_counts(), V > 0]),
    ?assertEqual(-1, Live()),
    %% Acked again: unmarked, so the next sweep keeps it.
    ok = convoy_channel:ack(T2),
    ?assertEqual(2, Live()),
    ok = dead_partials(?ACK_ROOM),
    ?assertEqual(?ACK_ROOM + 1, length(ack_counts())),
    ?assertEqual(-2, Live()),
    ?assertMatch(#{credit := 7, in_flight := 3}, convoy_channel:info(Ch)),
    %% Untouched through a sweep: its two acks go back as credit.
    ok = dead_partials(?ACK_ROOM),
    ?assertEqual(?ACK_ROOM, length(ack_counts())),
    ?assertEqual(undefined, Live()),
    ?assertMatch(#{credit := 9, in_flight := 1}, convoy_channel:info(Ch)),
    %% Credits to the closed channels were dropped with their aliases.
    ?assertEqual([], mailbox()),
    ok = convoy_channel:ack(T3),
    ?assertEqual(1, Live()),
    ok = convoy_channel:close(Ch).

%% Issue item 10: a consumer kept a partial ack count for every channel ever opened
%% to it. 10,100 channels closed and 10,100 whose producer died, each with half of
%% its `ack_every' acked, leave at most two sweeps' worth of counts; a live
%% channel's count went back to its producer, and the channel carries on.
ack_keys_bounded() ->
    C = spawn_link(fun acker/0),
    {ok, Live} = convoy_channel:open(C, #{window => 8, ack_every => 4, timeout => 0}),
    ok = send_n(Live, 1, 3),
    Opts = #{window => 8, ack_every => 4},
    [begin
         {ok, Ch} = convoy_channel:open(C, Opts),
         ok = send_n(Ch, 1, 2),
         ok = convoy_channel:close(Ch)
     end || _ <- lists:seq(1, 10100)],
    [begin
         {P, Mon} = spawn_monitor(
                      fun() ->
                              {ok, Ch} = convoy_channel:open(C, Opts),
                              ok = send_n(Ch, 1, 2),
                              ok = convoy_channel:send(Ch, {sync, self()}),
                              receive {synced, C} -> exit(died) end
                      end),
         receive {'DOWN', Mon, process, P, died} -> ok end
     end || _ <- lists:seq(1, 10100)],
    ?assertMatch(N when N =< 2 * ?ACK_ROOM, ack_counts(C)),
    %% The live channel's 3 acks came back (sent before the report).
    ?assertMatch(#{state := open, credit := 8, in_flight := 0}, convoy_channel:info(Live)),
    ok = send_n(Live, 4, 11),
    _ = ack_counts(C),
    ?assertMatch(#{credit := 8, in_flight := 0}, convoy_channel:info(Live)),
    ?assertEqual([], mailbox()),
    ok = convoy_channel:close(Live),
    C ! stop.

%% Nothing of a channel stays with its producer once it is closed, however it
%% ended: no dictionary key, monitor, credit or DOWN, whether its sends timed out,
%% its consumer died (seen by the producer or not), or credit was on its way.
producer_clean_after_close() ->
    {monitors, Monitors0} = process_info(self(), monitors),
    Keys = fun() -> [K || {{'$convoy_channel', _}, _} = K <- get()] end,
    %% Sends that timed out; credit coming before and after the close.
    Held = [begin
                H = holder(2),
                {ok, Ch} = convoy_channel:open(H, #{window => 2, ack_every => 1,
                                                    timeout => 0}),
                ok = send_n(Ch, 1, 2),
                receive {holding, H} -> ok end,
                {error, timeout} = convoy_channel:send(Ch, {item, 3}),
                H ! {ack, 1, self()},
                receive {acked, H} -> ok end,
                {Ch, H}
            end || _ <- lists:seq(1, 50)],
    %% Consumers that died; every other DOWN seen by send/2, the rest not.
    Dead = [begin
                C = holder(2),
                {ok, Ch} = convoy_channel:open(C, #{window => 2}),
                ok = send_n(Ch, 1, 2),
                receive {holding, C} -> ok end,
                Mon = monitor(process, C),
                exit(C, kill),
                receive {'DOWN', Mon, process, C, killed} -> ok end,
                _ = [{error, {consumer_down, killed}} = convoy_channel:send(Ch, {item, 3})
                     || I rem 2 =:= 0],
                Ch
            end || I <- lists:seq(1, 50)],
    ?assertEqual(100, length(Keys())),
    [ok = convoy_channel:close(Ch) || Ch <- Dead],
    [begin
         ok = convoy_channel:close(Ch),
         H ! {ack, 1, self()},
         receive {acked, H} -> H ! stop end
     end || {Ch, H} <- Held],
    ?assertEqual([], Keys()),
    ?assertEqual({monitors, Monitors0}, process_info(self(), monitors)),
    ?assertEqual([], mailbox()).

telemetry_and_stats() ->
    {module, telemetry} = code:ensure_loaded(telemetry),
    true = register(telemetry_sink, self()),
    try
        #{waits := W0, wait_time_us := U0} = convoy_channel:stats(),
        H = holder(1),
        {ok, Ch} = convoy_channel:open(H, #{window => 1, timeout => 20}),
        ok = convoy_channel:send(Ch, x),
        {error, timeout} = convoy_channel:send(Ch, y),
        {error, timeout} = convoy_channel:send(Ch, z),
        Events = [receive {telemetry, [convoy, channel, waited], M, Md} -> {M, Md} end
                  || _ <- [1, 2]],
        ?assertMatch([{#{duration := _}, #{consumer := H, result := timeout}},
                      {#{duration := _}, #{consumer := H, result := timeout}}], Events),
        [?assert(D >= erlang:convert_time_unit(20, millisecond, native))
         || {#{duration := D}, _} <- Events],
        #{waits := W1, wait_time_us := U1} = convoy_channel:stats(),
        ?assert(W1 - W0 >= 2),
        ?assert(U1 - U0 >= 40000),
        %% No event and no wait when credit is there.
        H ! stop,
        ok = convoy_channel:close(Ch),
        {ok, Ch2} = convoy_channel:open(self(), #{window => 3}),
        ok = send_n(Ch2, 1, 3),
        ?assertEqual([], [E || {telemetry, _, _, _} = E <- mailbox()]),
        ok = convoy_channel:close(Ch2)
    after
        unregister(telemetry_sink),
        flush_all()
    end.

%% The `telemetry' setting holds for the channel's event as for convoy's others:
%% with convoy running and `telemetry' false, a wait is counted but not emitted;
%% set to true, it is.
telemetry_setting() ->
    {module, telemetry} = code:ensure_loaded(telemetry),
    {ok, Sup} = convoy:start_link(#{telemetry => false}),
    unlink(Sup),
    true = register(telemetry_sink, self()),
    try
        #{waits := W0} = convoy_channel:stats(),
        H = holder(1),
        {ok, Ch} = convoy_channel:open(H, #{window => 1, timeout => 0}),
        ok = convoy_channel:send(Ch, x),
        {error, timeout} = convoy_channel:send(Ch, y),
        #{waits := W1} = convoy_channel:stats(),
        ?assertEqual(1, W1 - W0),
        ?assertEqual([], [E || {telemetry, _, _, _} = E <- mailbox()]),
        ok = convoy:set_config(#{telemetry => true}),
        {error, timeout} = convoy_channel:send(Ch, z),
        receive
            {telemetry, [convoy, channel, waited], _, #{consumer := H, result := timeout}} -> ok
        after 1000 ->
            error(no_event)
        end,
        H ! stop,
        ok = convoy_channel:close(Ch)
    after
        unregister(telemetry_sink),
        ok = proc_lib:stop(Sup, shutdown, infinity),
        flush_all()
    end.

flush_all() ->
    receive _ -> flush_all() after 0 -> ok end.
