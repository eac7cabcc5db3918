%% @doc Credit-based channels: a producer sends to one consumer, local or remote,
%% and never has more than `window' messages sent that the consumer has not yet
%% acknowledged as processed.
%%
%% A fast producer flooding a slow consumer builds a mailbox that grows without
%% bound and makes the consumer slower still. A channel gives the producer
%% `window' credits; each `send/2' spends one, and when none is left `send/2'
%% waits until the consumer gives some back, or until the consumer dies, its
%% node goes away, or the channel's `timeout' passes. The consumer calls
%% `ack/1' after it has processed a message; every `ack_every' acks one credit
%% message returns `ack_every' credits (as RabbitMQ's `credit_flow' does), so the
%% return traffic is one message per `ack_every' messages, not one per message.
%%
%% Messages and credits travel with `convoy:send/2' (batched between nodes, plain
%% sends when convoy is not running). A message reaches the consumer as
%% `{convoy_channel, Token, Msg}'; `recv/1' receives one, and `ack/1' takes its
%% `Token'.
%%
%% <h3>Example</h3>
%% ```
%% %% Consumer: processes each message, then acknowledges it.
%% consumer() ->
%%     case convoy_channel:recv(infinity) of
%%         {ok, Token, {job, N}} ->
%%             do_work(N),
%%             ok = convoy_channel:ack(Token),
%%             consumer();
%%         {ok, Token, {done, From}} ->
%%             ok = convoy_channel:ack(Token),
%%             From ! {consumer_done, self()}
%%     end.
%%
%% %% Producer: never more than 100 jobs ahead of the consumer.
%% produce(Consumer) ->                   % a pid, a local name or {Name, Node}
%%     {ok, Ch} = convoy_channel:open(Consumer, #{window => 100}),
%%     Result = send_all(Ch, lists:seq(1, 10000)),
%%     #{waits := Waits} = convoy_channel:info(Ch),
%%     ok = convoy_channel:close(Ch),
%%     {Result, Waits}.
%%
%% send_all(Ch, []) ->
%%     convoy_channel:send(Ch, {done, self()});
%% send_all(Ch, [N | Rest]) ->
%%     case convoy_channel:send(Ch, {job, N}) of
%%         ok -> send_all(Ch, Rest);
%%         {error, {consumer_down, Reason}} -> {error, {consumer_down, Reason}, N}
%%     end.
%% '''
%% A gen_server consumer gets the same `{convoy_channel, Token, Msg}' in
%% `handle_info/2' and calls `ack/1' when it is done with `Msg'.
%%
%% <h3>Rules</h3>
%% <ul>
%% <li>A channel belongs to the process that opened it: its state lives in that
%%   process's dictionary (key ``{'$convoy_channel', Ref}''); `send/2', `info/1' and
%%   `close/1' from any other process see a closed channel.</li>
%% <li>Invariant: `in_flight' (messages sent minus credits returned) never exceeds
%%   `window'; the consumer never holds more than `window' of the channel's
%%   messages.</li>
%% <li>The producer monitors the consumer. When the consumer dies or its node is
%%   disconnected, a waiting `send/2' returns `{error, {consumer_down, Reason}}' at
%%   once (`Reason' is `noconnection' for a lost node), and so does every later
%%   `send/2'. While credit remains, `send/2' does not look at the mailbox: as with
%%   `!', messages sent to a consumer that has died without the producer knowing
%%   are lost, at most `window' of them; the `DOWN' is seen when credit runs out or
%%   by `info/1'.</li>
%% <li>Credits arrive at the producer as ``{'$convoy_credit', Ref, N}'', sent to an
%%   alias of the producer. `send/2' reads them only when its credit is spent (then
%%   it takes all that are waiting), so the producer's mailbox holds at most
%%   `window div ack_every' of them. Other messages in the producer's mailbox are
%%   never touched. After `close/1' the alias is gone: late credits are dropped by
%%   the runtime, not left in the mailbox.</li>
%% <li>The consumer counts acks per channel in its process dictionary (key
%%   ``{'$convoy_ack', Ref}''), erased each time a batch of credit is returned. It
%%   cannot tell when a channel is gone, so counts left over are swept (see
%%   <em>Partial ack counts</em> below): a consumer fed by short-lived channels
%%   keeps at most 2048, however many come and go.</li>
%% <li>Waiting is counted: per channel in `info/1', node-wide in `stats/0', and by
%%   the telemetry event `[convoy, channel, waited]' (once per wait, never per
%%   message), under the rule of convoy's other events: when the `telemetry'
%%   module is loaded and the `telemetry' setting is true (the setting in force,
%%   or its default, true, while convoy is not running): measurements `#{duration}'
%%   (native time units), metadata `#{consumer, result}' with `result' one of
%%   `credit', `timeout', `{consumer_down, Reason}'.</li>
%% </ul>
%%
%% <h3>Partial ack counts</h3>
%% A channel closed, or whose producer died, with fewer than `ack_every' of its
%% messages acked since its last credit leaves a count that no ack will complete:
%% kept, a consumer fed by short-lived channels would hold one per channel.
%% Nothing tells the consumer that a channel is gone: a close message or a
%% monitor of the producer would put messages it never asked for in its mailbox
%% (a gen_server would get them in `handle_info/2'), a producer that dies sends
%% nothing, and the token names an alias, not a pid. So the counts are swept, as a clock (second chance) page
%% replacement does:
%% <ul>
%% <li><code>'$convoy_ack_room'</code> in the consumer's dictionary holds how many more
%%   counts it may start before the next sweep: 1024 after a sweep, one less for
%%   each count started, one more for each count completed (its credit sent);</li>
%% <li>a sweep sends, as credit to its channel, every count not acked since the
%%   previous sweep, and marks the others (stores them negated; the channel's
%%   next ack unmarks it);</li>
%% <li>so a count that nobody acks any more goes at the second sweep after its
%%   last ack, and the consumer holds at most 1024 counts more than the channels it
%%   acked between its last two sweeps: at most 2048 (some 400 kB of heap) when
%%   it is fed by short-lived channels, however many come and go.</li>
%% </ul>
%% A sweep sends what the consumer acked, never more: `in_flight' stays exact and
%% the window is kept. The credit of a channel that is gone goes to an alias that
%% is no more, and the runtime drops it; a live channel gets its credit early
%% rather than never, one message of less than `ack_every' at most once per sweep,
%% so no wake-up storm. Counts started and completed in turn give their room back:
%% a consumer whose channels stay open stops sweeping once each has its count, for
%% up to about 2000 channels acked in rotation (with more, counts are swept before
%% they complete and credit goes back about once per ack instead of once per
%% `ack_every'). An ack that continues a count costs what it did (one `get', one
%% `put'); one that starts or completes a count also updates the room; one new
%% count in 1024 pays for a sweep: a pass over the consumer's process dictionary
%% and one credit message per count swept.
-module(convoy_channel).

-export([open/2, send/2, ack/1, recv/1, close/1, info/1, stats/0]).

-export_type([channel/0, token/0, open_opts/0, consumer/0, channel_info/0, open_error/0,
              send_error/0]).

-include("convoy_tags.hrl").

-record(convoy_channel, {ref :: reference(),                 % the producer's alias
                         mon :: reference(),
                         consumer :: pid() | {atom(), node()},
                         window :: pos_integer(),
                         ack_every :: pos_integer(),
                         timeout :: timeout(),
                         token :: token()}).

%% Producer-side state, in the producer's process dictionary.
-record(chs, {sent = 0 :: non_neg_integer(),
              credited = 0 :: non_neg_integer(),
              waits = 0 :: non_neg_integer(),
              wait_time = 0 :: non_neg_integer(),       % native units
              state = open :: open | {down, term()}}).

-opaque channel() :: #convoy_channel{}.
%% The producer's handle of a channel.
-opaque token() :: {reference(), pos_integer()}.
%% What the consumer passes to `ack/1': the producer's alias for credits and
%% `ack_every'. Small: it travels with every message.
-type consumer() :: pid() | atom() | {atom(), node()}.
%% A process, a locally registered name (resolved to its pid when the channel
%% opens), or a name registered on a node.
-type open_opts() :: #{window => pos_integer(),
                       ack_every => pos_integer(),
                       timeout => timeout()}.
%% `window': most messages sent but not yet acknowledged (default 1000);
%% `ack_every': acks per credit message, at most `window' (default
%% `max(1, window div 2)'); `timeout': milliseconds `send/2' may wait for credit,
%% at most 4294967295 (default `infinity'). Checked by `convoy_config', as the
%% settings are.
-type open_error() :: convoy_config:error() | noproc.
%% A bad option, or a local consumer that does not exist (see `open/2').
-type send_error() :: timeout | {consumer_down, term()} | closed.
%% Why `send/2' did not send: no credit within the channel's `timeout', the
%% consumer gone (or its node), or the channel closed (or not the caller's).
-type channel_info() :: #{credit := non_neg_integer(),
                          in_flight := non_neg_integer(),
                          window := pos_integer(),
                          waits := non_neg_integer(),
                          wait_time_us := non_neg_integer(),
                          state := open | down | closed}.
%% What `info/1' returns.

-define(KEY(Ref), {'$convoy_channel', Ref}).
-define(ACK_KEY(Ref), {'$convoy_ack', Ref}).
-define(ACK_ROOM_KEY, '$convoy_ack_room').
-define(ACK_ROOM, 1024).                        % new partial counts between sweeps
-define(STATS_KEY, {?MODULE, stats}).

%%--------------------------------------------------------------------
%% Producer

%% @doc Open a channel from the calling process (the producer) to `Consumer'.
%%
%% Monitors the consumer. A local name nobody holds, or a local pid that is not
%% alive, gives `{error, noproc}'; for a remote consumer that does not exist the
%% first `send/2' that has to wait returns `{error, {consumer_down, noproc}}'.
%% Options are checked key by key: an unknown key gives `{error, {bad_option,
%% Key}}', a bad value `{error, {bad_value, Key, Value}}' (`ack_every' above
%% `window' is a bad value of `ack_every'; a list of `{Key, Value}' is taken as the
%% map of its pairs, a key twice in it is `{duplicate_option, Key}'). Raises
%% `badarg' if `Consumer' is not a pid, an atom or `{Name, Node}', or `Opts' is
%% neither a map nor a list.
-spec open(consumer(), open_opts() | [{atom(), term()}]) ->
          {ok, channel()} | {error, open_error()}.
open(Consumer, Opts) when is_map(Opts); is_list(Opts) ->
    case {dest(Consumer), convoy_config:channel_options(Opts)} of
        {error, _} ->
            erlang:error(badarg, [Consumer, Opts]);
        {_, {error, _} = E} ->
            E;
        {noproc, _} ->
            {error, noproc};
        {Dest, {ok, #{window := W, ack_every := A, timeout := T}}} ->
            %% Credits go to an alias, not to the pid: once the channel is closed
            %% or down the alias is inactive and late credits are dropped.
            Ref = alias([explicit_unalias]),
            Mon = erlang:monitor(process, Dest),
            put(?KEY(Ref), #chs{}),
            {ok, #convoy_channel{ref = Ref, mon = Mon, consumer = Dest, window = W,
                                 ack_every = A, timeout = T, token = {Ref, A}}}
    end;
open(Consumer, Opts) ->
    erlang:error(badarg, [Consumer, Opts]).

dest(Pid) when is_pid(Pid), node(Pid) =:= node() ->
    case is_process_alive(Pid) of
        true -> Pid;
        false -> noproc
    end;
dest(Pid) when is_pid(Pid) -> Pid;
dest(Name) when is_atom(Name) ->
    case whereis(Name) of
        undefined -> noproc;
        Pid -> Pid
    end;
dest({Name, Node}) when is_atom(Name), Node =:= node() -> dest(Name);
dest({Name, Node}) when is_atom(Name), is_atom(Node) -> {Name, Node};
dest(_) -> error.

%% @doc Send `Msg' to the channel's consumer as `{convoy_channel, Token, Msg}'.
%%
%% With credit left, spends one and sends at once (`convoy:send/2'). Without,
%% waits (a selective receive on the channel's reference: other messages stay in
%% the mailbox) for credit, for the consumer's `DOWN' or for the channel's
%% `timeout'. On `{error, timeout}' the message was not sent and the channel stays
%% open; on `{error, {consumer_down, Reason}}' it was not sent and every later
%% send returns the same error; `{error, closed}' after `close/1' (or from a
%% process that does not own the channel).
-spec send(channel(), term()) -> ok | {error, send_error()}.
send(Ch = #convoy_channel{ref = Ref, window = W}, Msg) ->
    case get(?KEY(Ref)) of
        S = #chs{state = open, sent = Sent, credited = Cr} when Sent - Cr < W ->
            deliver(Ch, S, Msg);
        S = #chs{state = open} ->
            case refill(Ch, S) of
                {ok, S1} ->
                    deliver(Ch, S1, Msg);
                {error, Reason, S1} ->
                    put(?KEY(Ref), S1),
                    {error, Reason}
            end;
        #chs{state = {down, Reason}} ->
            {error, {consumer_down, Reason}};
        undefined ->
            {error, closed}
    end;
send(Ch, Msg) ->
    erlang:error(badarg, [Ch, Msg]).

deliver(#convoy_channel{ref = Ref, consumer = C, token = Token}, S = #chs{sent = Sent}, Msg) ->
    put(?KEY(Ref), S#chs{sent = Sent + 1}),
    %% convoy_route (what convoy:send/2 calls), not the facade: convoy calls this
    %% module for stats/0, and the two must not depend on each other.
    convoy_route:send(C, {convoy_channel, Token, Msg}).

%% Credit is spent: take what has arrived; wait only if that is nothing.
refill(Ch = #convoy_channel{ref = Ref, mon = Mon, window = W}, S0) ->
    case collect(Ref, Mon, S0) of
        S = #chs{state = {down, Reason}} ->
            {error, {consumer_down, Reason}, S};
        S = #chs{sent = Sent, credited = Cr} when Sent - Cr < W ->
            {ok, S};
        S ->
            wait(Ch, S)
    end.

%% Every credit and a DOWN already in the mailbox, without waiting. The consumer's
%% credits come before its DOWN, so all of them are counted first.
collect(Ref, Mon, S) ->
    receive
        {?TAG_CREDIT, Ref, N} -> collect(Ref, Mon, credit(S, N));
        {'DOWN', Mon, process, _, Reason} -> down(Ref, Reason, S)
    after 0 ->
            S
    end.

%% Credits never exceed what is in flight, whatever a consumer acks.
credit(S = #chs{sent = Sent, credited = Cr}, N) when is_integer(N), N > 0 ->
    S#chs{credited = min(Sent, Cr + N)};
credit(S, _) ->
    S.

wait(#convoy_channel{ref = Ref, mon = Mon, consumer = C, timeout = Timeout, window = W},
     S0) ->
    T0 = erlang:monotonic_time(),
    Deadline = case Timeout of
                   infinity -> infinity;
                   _ -> T0 + erlang:convert_time_unit(Timeout, millisecond, native)
               end,
    {Result, S1} = wait_loop(Ref, Mon, W, Deadline, Timeout, S0),
    Dur = erlang:monotonic_time() - T0,
    S = S1#chs{waits = S1#chs.waits + 1, wait_time = S1#chs.wait_time + Dur},
    record_wait(C, Dur, Result),
    case Result of
        credit -> {ok, S};
        Error -> {error, Error, S}
    end.

wait_loop(Ref, Mon, W, Deadline, Timeout, S) ->
    receive
        {?TAG_CREDIT, Ref, N} ->
            S1 = #chs{sent = Sent, credited = Cr} = credit(S, N),
            case Sent - Cr < W of
                true -> {credit, S1};
                false -> wait_loop(Ref, Mon, W, Deadline, remaining(Deadline), S1)
            end;
        {'DOWN', Mon, process, _, Reason} ->
            {{consumer_down, Reason}, down(Ref, Reason, S)}
    after Timeout ->
            {timeout, S}
    end.

%% The consumer is gone: no credit can come; credits still in the mailbox (sent
%% before the DOWN) are dropped with the alias.
down(Ref, Reason, S) ->
    true = unalias(Ref),
    ok = flush_credits(Ref),
    S#chs{state = {down, Reason}}.

remaining(infinity) ->
    infinity;
remaining(Deadline) ->
    Native = max(0, Deadline - erlang:monotonic_time()),
    erlang:convert_time_unit(Native, native, millisecond).

record_wait(Consumer, Dur, Result) ->
    ok = convoy_metrics:add_wait(stats_ref(), Dur),
    convoy_metrics:event([convoy, channel, waited], #{duration => Dur},
                         #{consumer => Consumer, result => Result}).

%% @doc Close the channel: demonitor the consumer, drop the producer's state and
%% any credit waiting in the mailbox. Credits the consumer returns later are
%% dropped by the runtime (they are addressed to an alias that no longer exists).
%% Messages already sent are not recalled. Closing twice is harmless.
-spec close(channel()) -> ok.
close(#convoy_channel{ref = Ref, mon = Mon}) ->
    _ = erase(?KEY(Ref)),
    _ = unalias(Ref),
    true = erlang:demonitor(Mon, [flush]),
    flush_credits(Ref);
close(Ch) ->
    erlang:error(badarg, [Ch]).

flush_credits(Ref) ->
    receive
        {?TAG_CREDIT, Ref, _} -> flush_credits(Ref)
    after 0 ->
            ok
    end.

%% @doc The channel as the producer sees it, after taking any credit (and `DOWN')
%% waiting in its mailbox. `credit' is what `send/2' may send without waiting,
%% `in_flight' what was sent and not yet credited back (`credit + in_flight =
%% window' while open; once down, `credit' is 0 and `in_flight' what was
%% unconfirmed when the consumer went down). `waits' and `wait_time_us' count the
%% sends that had to wait and for how long. A closed channel (or one owned by
%% another process) shows `state => closed' and zeros.
-spec info(channel()) -> channel_info().
info(#convoy_channel{ref = Ref, mon = Mon, window = W}) ->
    case get(?KEY(Ref)) of
        undefined ->
            #{state => closed, credit => 0, in_flight => 0, window => W, waits => 0,
              wait_time_us => 0};
        S0 ->
            S = #chs{sent = Sent, credited = Cr, state = St} =
                case S0#chs.state of
                    open -> collect(Ref, Mon, S0);
                    _ -> S0
                end,
            put(?KEY(Ref), S),
            InFlight = Sent - Cr,
            {State, Credit} = case St of
                                  open -> {open, W - InFlight};
                                  {down, _} -> {down, 0}
                              end,
            #{state => State, credit => Credit, in_flight => InFlight, window => W,
              waits => S#chs.waits, wait_time_us => us(S#chs.wait_time)}
    end;
info(Ch) ->
    erlang:error(badarg, [Ch]).

%% @doc Node-wide totals since the node started: how many `send/2' calls waited
%% for credit and for how long, over all channels.
%%
%% Kept in a `counters' array (`convoy_metrics:new_waits/0') stored in
%% `persistent_term', created on the first wait. It does not belong to convoy's
%% supervision tree, so channels work and are counted whether or not convoy is
%% running, and restarting convoy keeps the totals. The one-time creation runs
%% under a node-local `global:trans/3' lock so that two first waits cannot each
%% install an array and lose counts (and a `persistent_term' key is never
%% replaced, which would cost a global GC).
-spec stats() -> #{waits := non_neg_integer(), wait_time_us := non_neg_integer()}.
stats() ->
    case persistent_term:get(?STATS_KEY, undefined) of
        undefined ->
            #{waits => 0, wait_time_us => 0};
        C ->
            {Waits, Time} = convoy_metrics:waits(C),
            #{waits => Waits, wait_time_us => us(Time)}
    end.

stats_ref() ->
    case persistent_term:get(?STATS_KEY, undefined) of
        undefined ->
            case global:trans({?STATS_KEY, self()}, fun create_stats/0, [node()]) of
                aborted -> erlang:error({convoy_channel, stats_lock_aborted});
                C -> C
            end;
        C ->
            C
    end.

create_stats() ->
    case persistent_term:get(?STATS_KEY, undefined) of
        undefined ->
            C = convoy_metrics:new_waits(),
            persistent_term:put(?STATS_KEY, C),
            C;
        C ->
            C
    end.

us(Native) ->
    erlang:convert_time_unit(Native, native, microsecond).

%%--------------------------------------------------------------------
%% Consumer

%% @doc Receive the next channel message: `{ok, Token, Msg}', or `timeout' after
%% `Timeout' milliseconds. Other messages stay in the mailbox. Does not ack: call
%% `ack(Token)' once `Msg' is processed, so that the window bounds the work the
%% consumer has not done yet, not just its mailbox.
-spec recv(timeout()) -> {ok, token(), term()} | timeout.
recv(Timeout) when Timeout =:= infinity; is_integer(Timeout), Timeout >= 0 ->
    receive
        {convoy_channel, {Ref, A} = Token, Msg} when is_reference(Ref), is_integer(A), A > 0 ->
            {ok, Token, Msg}
    after Timeout ->
            timeout
    end;
recv(Timeout) ->
    erlang:error(badarg, [Timeout]).

%% @doc Acknowledge one processed message of the channel `Token' came with. Every
%% `ack_every' acks of a channel, `ack_every' credits go back to its producer in
%% one message. Called by the consumer (the count is in its process dictionary;
%% counts of channels that are gone are swept, see <em>Partial ack counts</em>).
%% Acking a message twice does not let the producer exceed its window. Raises
%% `badarg' if `Token' is not a token.
-spec ack(token()) -> ok.
ack({Ref, A}) when is_reference(Ref), is_integer(A), A > 0 ->
    Key = ?ACK_KEY(Ref),
    case get(Key) of
        N when is_integer(N), N > 0, N + 1 < A ->
            _ = put(Key, N + 1),
            ok;
        undefined when A =:= 1 ->
            return_credit(Ref, 1);
        undefined ->
            _ = put(Key, 1),
            count_started();
        N when is_integer(N), N < 0, 1 - N < A ->
            %% Marked by the last sweep and acked since: unmarked.
            _ = put(Key, 1 - N),
            ok;
        _ ->
            _ = erase(Key),
            count_ended(),
            return_credit(Ref, A)
    end;
ack(Token) ->
    erlang:error(badarg, [Token]).

return_credit(Ref, N) ->
    convoy_route:send(Ref, {?TAG_CREDIT, Ref, N}).

%% A new partial count takes a unit of room; the last unit pays for a sweep.
count_started() ->
    case get(?ACK_ROOM_KEY) of
        R when is_integer(R), R > 1 ->
            _ = put(?ACK_ROOM_KEY, R - 1),
            ok;
        undefined ->
            _ = put(?ACK_ROOM_KEY, ?ACK_ROOM - 1),
            ok;
        _ ->
            sweep()
    end.

%% A count erased with its credit gives its room back.
count_ended() ->
    case get(?ACK_ROOM_KEY) of
        R when is_integer(R) ->
            _ = put(?ACK_ROOM_KEY, R + 1),
            ok;
        _ ->
            ok
    end.

%% Return the counts not acked since the last sweep, mark the others.
sweep() ->
    lists:foreach(fun sweep_count/1, get()),
    _ = put(?ACK_ROOM_KEY, ?ACK_ROOM),
    ok.

sweep_count({?ACK_KEY(Ref) = Key, N}) when is_integer(N), N < 0 ->
    _ = erase(Key),
    return_credit(Ref, -N);
sweep_count({?ACK_KEY(_) = Key, N}) when is_integer(N), N > 0 ->
    _ = put(Key, -N),
    ok;
sweep_count(_) ->
    ok.
